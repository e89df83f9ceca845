"""Old import paths of modules that moved, kept for one release, served from one table.

A module documented under an old path (`expbuf.server.selection`, say) stays importable there
with no file of its own: each name read from it is the moved module's, with a DeprecationWarning
that names the new path, attributed to the line that read it. The old paths go in the release
after the one that moved them (CHANGELOG.md).

Each side keeps its old paths in one table, {old dotted path: the module that holds its names
now}, and hands it to `serve` as its package is imported (`expbuf.client` and `expbuf.server`'s
`__init__`): the import system always loads a package before it looks for a module under it, so
the table is in place before any old path under it is asked for. One finder at the end of
`sys.meta_path` answers for the paths of every table, after the import system found no file for
them; the new module is imported only when its old path is. It lives at the bottom of the client,
which imports nothing of the server, so that the client's table and the server's share it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType


def moved(old: str, new: ModuleType) -> Callable[[str], object]:
    """The module `__getattr__` of the old path `old`: its names, read from `new`."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # a module's own (__file__, __path__, ...): an old path has none of new's
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(new, name)  # an unknown name is an AttributeError, with no warning
        warnings.warn(
            f"{old} moved to {new.__name__}: import {name} from there ({old} goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder and loader of every old path: a module under the old name whose names are
    read from the new module (PEP 562's module `__getattr__`), as `moved` reads them."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}  # old dotted path -> the new module's

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.table:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=f"moved to {self.table[fullname]}")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = importlib.import_module(self.table[spec.name])
        module = ModuleType(spec.name, f"Deprecated: moved to {new.__name__} (client/moved.py).")
        module.__dict__["__getattr__"] = moved(spec.name, new)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module's names are the new module's, read as they are asked for."""


FINDER = OldPaths()  # the one finder of every side's old paths


def serve(table: Mapping[str, str]) -> None:
    """Serve each old path of `table` ({old dotted path: new module path}) from now on."""
    FINDER.table.update(table)
    if FINDER not in sys.meta_path:
        sys.meta_path.append(FINDER)
