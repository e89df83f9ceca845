"""expbuf's hot modules compiled with mypyc (by `make setup` in a checkout, or into the wheel by
setup.py, from the same sources), used in place of those sources only while they are what the
sources compile to.

A compiled package keeps its extension modules in `_native/` beside its sources, with a
manifest of the SHA-256 of each source they were built from. `use_compiled` puts that
folder ahead of the sources in the package's `__path__` when every digest matches the source
as it is now; otherwise it warns and leaves the package pure Python. Digests rather than
file times: a checkout or a copy changes times without changing the code, and an edit saved
within the same second as a build must still count. `EXPBUF_PURE_PYTHON=1` keeps every
package pure Python, so one machine can run expbuf both ways.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import sysconfig
import types
import warnings
from pathlib import Path
from typing import Any

# The folder of a package's compiled modules and their manifest, as the build writes them.
from .native_build import MANIFEST, NATIVE

PURE_PYTHON = "EXPBUF_PURE_PYTHON"
SOURCE_PREFIX = "_expbuf_source"


def pure_python() -> bool:
    """Whether EXPBUF_PURE_PYTHON asks for the sources even where compiled modules exist."""
    return os.environ.get(PURE_PYTHON, "") not in ("", "0")


def _manifest(folder: Path) -> dict[str, Any] | None:
    """What a package folder's build says of its compiled modules; None if it has none."""
    try:
        manifest: dict[str, Any] = json.loads((folder / NATIVE / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    return manifest


def stale(folder: Path) -> list[str] | None:
    """The modules of a package folder whose compiled form no longer matches its source (or
    was built for another Python); None if the folder has no compiled modules."""
    manifest = _manifest(folder)
    if manifest is None:
        return None
    sources: dict[str, str] = manifest["sources"]
    if manifest["abi"] != sysconfig.get_config_var("EXT_SUFFIX"):
        return sorted(sources)
    changed = []
    for module, digest in sources.items():
        source = folder / f"{module}.py"
        if not source.exists() or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            changed.append(module)
    return changed


def use_compiled(package: str, path: list[str]) -> bool:
    """Put a package's compiled modules ahead of its sources (its `__path__`), unless pure
    Python is asked for or any of them is stale; return whether it did."""
    folder = Path(path[0])
    if pure_python():
        return False
    changed = stale(folder)
    if changed is None:
        return False
    if changed:
        warnings.warn(
            f"expbuf: the compiled modules of {package} do not match their sources ({', '.join(changed)} changed); "
            "using the pure-Python modules (run `make setup`, or reinstall expbuf, to rebuild them)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    # Its modules call those of the packages it needs by their compiled names: with any of those pure
    # Python (stale, say), its own import would fail, so it stays pure Python too.
    needs = (_manifest(folder) or {}).get("needs", [])
    missing = [name for name in needs if not in_use(name)]
    if missing:
        warnings.warn(
            f"expbuf: the compiled modules of {package} call those of {', '.join(missing)}, which are not in use; "
            "using the pure-Python modules (run `make setup`, or reinstall expbuf, to rebuild them)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    path.insert(0, str(folder / NATIVE))
    return True


def in_use(package: str) -> bool:
    """Whether a package's compiled modules are in use (ahead of its sources on its `__path__`)."""
    return any(Path(entry).name == NATIVE for entry in importlib.import_module(package).__path__)


def compiled(module: str) -> bool:
    """Whether an imported module is the compiled one."""
    return Path(sys.modules[module].__file__ or "").suffix != ".py"


def source_module(name: str) -> types.ModuleType:
    """The expbuf module `name` (e.g. "expbuf.client.trxp.codec.parse") run from its source, under
    SOURCE_PREFIX + the rest of its name, whether or not its compiled form is in use: the same
    code side by side with the compiled module, for the tests that hold the two to the same
    verdicts and the benchmarks that compare them. The package `__init__`s are not run; what the
    module imports is read from source under the same prefix."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        alias = ".".join([SOURCE_PREFIX, *parts[1:depth]])
        if alias not in sys.modules:
            package = types.ModuleType(alias)
            paths = importlib.import_module(".".join(parts[:depth])).__path__
            package.__path__ = [path for path in paths if Path(path).name != NATIVE]
            sys.modules[alias] = package
    return importlib.import_module(".".join([SOURCE_PREFIX, *parts[1:]]))
