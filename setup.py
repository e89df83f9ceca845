"""expbuf's wheel, with the TRXP codec's hot modules compiled by mypyc (client/native_build.py).

Everything but the list of packages and the build of the compiled modules is in pyproject.toml.
The packages are found here, from pyproject's package-dir roots, so that a new folder of modules
ships without a list to keep in step (a list once left every sub-package out of the wheel). They are built after the
sources are laid out, into `expbuf/client/trxp/{codec,stored}/_native/`, each with the manifest of its sources beside
them; without a C compiler the wheel is pure Python and the build says so in one line (pip shows
it with -v), unless EXPBUF_REQUIRE_NATIVE=1 makes that an error. An editable install builds nothing
here: `make setup` compiles in the tree (python client/native_build.py).
"""

from __future__ import annotations

import importlib.util
import tomllib
import types
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def native_build() -> types.ModuleType:
    """client/native_build.py, loaded by path: the expbuf package is not importable while it is built."""
    path = HERE / "client" / "native_build.py"
    spec = importlib.util.spec_from_file_location("native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def packages() -> list[str]:
    """Every folder with an __init__.py under a package-dir root, named as installed."""
    roots = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {HERE / folder: name for name, folder in roots.items()}
    found = []
    for folder, name in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            inner = [folder / Path(*parts[:depth]) for depth in range(1, len(parts) + 1)]
            if not any(path in folders for path in inner):  # server/ray is a root of its own
                found.append(".".join((name, *parts)))
    return sorted(found)


class BuildNative(build_ext):
    """Compiles the hot modules into the wheel's tree (build_lib), not in place."""

    def run(self) -> None:
        if self.editable_mode or self.inplace:
            return
        build = native_build()
        build.compile_into(build.in_lib(Path(self.build_lib)), Path(self.build_temp) / "native")


class PlatformDistribution(Distribution):
    """A wheel for the Python and platform it was built on, as its compiled modules are."""

    def has_ext_modules(self) -> bool:
        return True


setup(packages=packages(), distclass=PlatformDistribution, cmdclass={"build_ext": BuildNative})
