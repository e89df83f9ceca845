"""Regenerate the committed Python code of the wire contract.

The generated modules are committed so that installing expbuf needs no protoc
step; tests/test_proto.py fails when they drift from the .proto files.

    python proto/generate.py            # rewrite proto/expbuf/v1/*_pb2*.py
    python proto/generate.py OUT_DIR    # write them to OUT_DIR instead
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "expbuf" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto of expbuf.v1 into out_dir; return the files written."""
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    grpc_include = Path(protoc.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{grpc_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "expbuf" / "v1").iterdir()):
            text = src.read_text()
            # Installed, the package is expbuf.proto.v1, not expbuf.v1: import siblings relatively.
            text = re.sub(r"^from expbuf\.v1 import ", "from . import ", text, flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR
    for path in generate(target):
        print(path)
