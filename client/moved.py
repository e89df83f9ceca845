"""Old import paths of modules that moved, kept for one release.

A module documented under an old path (`expbuf.server.selection`, say) stays importable
there: each name read from it is the moved module's, with a DeprecationWarning that names the
new path, attributed to the line that read it. The old paths go in the release after the one
that moved them (CHANGELOG.md). An old path is either a file of its own whose module
`__getattr__` is `moved(...)`, or, with no file, an `alias` the package that holds its names
now installs as it is imported (a package's old submodule: the import system loads the package
before it looks for the submodule). It lives at the bottom of the client, which imports nothing
of the server, so that the client's old paths and the server's share it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import ModuleType


def moved(old: str, new: ModuleType) -> Callable[[str], object]:
    """The module `__getattr__` of the old path `old`: its names, read from `new`."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # a module's own (__file__, __path__, ...): an alias has none of new's
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(new, name)  # an unknown name is an AttributeError, with no warning
        warnings.warn(
            f"{old} moved to {new.__name__}: import {name} from there ({old} goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__


def alias(old: str, new: ModuleType) -> None:
    """Serve the old path `old`, a submodule of a package already imported, from `new` without a
    file: a module under that name (in sys.modules and as its package's attribute) whose names
    are read from `new` as `moved` reads them."""
    module = ModuleType(old, f"Deprecated: moved to {new.__name__} (client/moved.py).")
    module.__dict__["__getattr__"] = moved(old, new)  # PEP 562: read for a name the module lacks
    sys.modules[old] = module
    parent, _, name = old.rpartition(".")
    setattr(sys.modules[parent], name, module)
