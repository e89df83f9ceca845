"""Build expbuf's hot modules with mypyc from their own sources (`make setup` runs this).

Each compiled package gets a `_native/` folder beside its sources: the extension modules
and a manifest of the SHA-256 of every source they were built from. expbuf.client.native
puts that folder ahead of the sources at import only while every digest still matches, so
an edited source is never shadowed by a module compiled from its older self.

Where there is no C compiler, or the build fails, the `_native/` folders are removed and
one line says expbuf runs as pure Python; the exit status is 0 either way, as that is a
working install.

    python client/native_build.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the source tree
# package folder -> (package as installed, modules compiled). Each package is one mypyc group,
# so its modules call each other directly. What paid in bench/bench_native.py: the parse and its
# checks and pickle scan, about twice as fast. The store's records did not (their cost is in
# struct and the dataclass's construction, already C), so they stay as written.
COMPILED = {
    "client/trxp": ("expbuf.client.trxp", ("checks", "common", "parse", "pickles")),
}
# The folders the compiled modules import from, under their installed names (pyproject.toml's package-dir).
LINKS = {"client": "client"}
NATIVE = "_native"
# Where it builds: the same path each time, so that mypy's cache there spares most of a rebuild.
WORK = ROOT / "build" / "native"
MANIFEST = "manifest.json"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clear() -> None:
    for folder in COMPILED:
        shutil.rmtree(ROOT / folder / NATIVE, ignore_errors=True)


def build(work: Path) -> None:
    """Compile every group in `work`, then copy each package's modules and manifest in place."""
    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    # mypy finds modules by path: link the packages under the names they are installed as.
    src = work / "src"
    (src / "expbuf").mkdir(parents=True)
    for name, folder in LINKS.items():
        (src / "expbuf" / name).symlink_to(ROOT / folder, target_is_directory=True)
    groups: list[tuple[list[str], str | None]] = [
        ([str(src / "expbuf" / folder / f"{module}.py") for module in modules], f"{package}.native")
        for folder, (package, modules) in COMPILED.items()
    ]
    paths = [path for files, _ in groups for path in files]
    os.environ["MYPYPATH"] = str(src)
    extensions = mypycify(
        # Only the compiled modules are read: what they import from elsewhere is Any to them, which
        # spares the build a type check of all that expbuf imports (tests/typecheck.py does that).
        [
            "--config-file",
            "",
            "--follow-imports",
            "skip",
            "--python-version",
            "3.11",
            "--cache-dir",
            str(work / "mypy"),
            "--explicit-package-bases",
            *paths,
        ],
        opt_level="3",
        separate=groups,
        target_dir=str(work / "c"),
    )
    dist = Distribution({"name": "expbuf-native", "ext_modules": extensions})
    dist.script_args = ["-q", "build_ext", "--build-lib", str(work / "lib"), "--build-temp", str(work / "tmp")]
    dist.parse_command_line()
    dist.run_commands()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for folder, (package, modules) in COMPILED.items():
        built = work / "lib" / package.replace(".", "/")
        target = ROOT / folder / NATIVE
        target.mkdir()
        for module in built.glob(f"*{suffix}"):
            shutil.copy2(module, target / module.name)
        manifest = {
            "abi": suffix,
            "sources": {module: digest(ROOT / folder / f"{module}.py") for module in modules},
        }
        (target / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> int:
    clear()
    try:
        for stale in ("src", "lib"):  # links and modules of the last build; its mypy cache and objects stay
            shutil.rmtree(WORK / stale, ignore_errors=True)
        build(WORK)
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error; a missing compiler raises
        clear()
        if os.environ.get("EXPBUF_NATIVE_VERBOSE"):
            traceback.print_exc()
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        print(f"expbuf: compiled modules not built ({reason}); expbuf runs as pure Python")
        return 0
    names = ", ".join(f"{package}.{module}" for package, modules in COMPILED.values() for module in modules)
    print(f"expbuf: compiled with mypyc: {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
