"""Old import paths of modules that moved, kept for one release.

A module documented under an old path (`expbuf.server.store.selection`, say) stays importable
there: each name read from it is the moved module's, with a DeprecationWarning that names the
new path, attributed to the line that read it. The old paths go in the release after the one
that moved them (CHANGELOG.md). It lives at the bottom of the client, which imports nothing of
the server, so that the client's old paths and the server's share it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType


def moved(old: str, new: ModuleType) -> Callable[[str], object]:
    """The module `__getattr__` of the old path `old`: its names, read from `new`."""

    def __getattr__(name: str) -> object:
        value = getattr(new, name)  # an unknown name is an AttributeError, with no warning
        warnings.warn(
            f"{old} moved to {new.__name__}: import {name} from there ({old} goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
