"""Import a framework adapter and every module of it, as its users' code and their framework's
loaders do; the packages named after it are refused as if they were not installed.

    python tests/import_adapter.py expbuf.client.verl [trinity,areal,...]

`make check-extras` runs it in a virtualenv holding only the adapter's extra; tests/test_extras.py
in the test environment, refusing the other adapters' frameworks. It prints how many modules it
imported; a module that cannot be imported fails it with the import's traceback.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType


class NotInstalled(MetaPathFinder):
    """Refuses the top-level packages it is given, as an environment without them would."""

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.partition(".")[0] in self.refused:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def import_all(adapter: str) -> list[str]:
    """The adapter's modules, each imported (the lazily loaded ones too)."""
    package = importlib.import_module(adapter)
    names = [package.__name__]
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
        names.append(module.name)
    return names


def main(argv: list[str]) -> int:
    refused = {name for name in (argv[2] if len(argv) > 2 else "").split(",") if name}
    sys.meta_path.insert(0, NotInstalled(refused))
    names = import_all(argv[1])
    print(f"{argv[1]}: {len(names)} modules imported")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
