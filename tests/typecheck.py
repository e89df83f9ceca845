"""Type-check expbuf with mypy under the names it is installed as (`make test` runs this).

pyproject.toml maps `expbuf.server` to server/, `expbuf.ray` to server/ray and so on, and mypy
finds modules by path only. So the packages are read through links named as installed
(.mypy_cache/src/expbuf/server -> server/), laid out from where the install's own import
machinery finds each package, and the errors are printed with the real paths. Settings live in
pyproject.toml ([tool.mypy]); arguments are passed on to mypy. Without arguments, the packages are
checked, then TYPINGS (mypy takes packages or files in one run, not both).

    python tests/typecheck.py
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
LINKS = ROOT / ".mypy_cache" / "src" / "expbuf"
PACKAGES = ("server", "client", "ray", "proto")
# Files of what mypy must see of expbuf: the clients' declared calls, their signatures and results.
TYPINGS = ["tests/typing_clients.py"]


def lay_out_links() -> dict[str, str]:
    """Link each installed package under LINKS; return link path prefix -> real path prefix."""
    shutil.rmtree(LINKS, ignore_errors=True)
    LINKS.mkdir(parents=True)
    prefixes = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec("expbuf." + name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"expbuf.{name} is not installed: run `make setup` first")
        real = Path(spec.submodule_search_locations[0]).resolve()
        (LINKS / name).symlink_to(real, target_is_directory=True)
        prefixes[os.path.relpath(LINKS / name, ROOT) + os.sep] = os.path.relpath(real, ROOT) + os.sep
    return prefixes


def main(argv: list[str]) -> int:
    prefixes = lay_out_links()
    os.chdir(ROOT)
    status = 0
    for args in [argv] if argv else [[], TYPINGS]:
        out, err, code = api.run(args)
        for link, real in prefixes.items():
            out = out.replace(link, real)
        sys.stdout.write(out)
        sys.stderr.write(err)
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
