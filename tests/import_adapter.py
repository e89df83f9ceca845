"""Import a framework adapter and every module of it, as its users' code and their framework's
loaders do; the packages named after it are refused as if they were not installed.

    python tests/import_adapter.py expbuf.client.verl [trinity,areal,...]

`make check-extras` runs it in a virtualenv holding only the adapter's extra. It prints how many
modules it imported; a module that cannot be imported fails it with the import's traceback.

    python tests/import_adapter.py --each expbuf.client.verl=trinity,areal,... expbuf.client.trl=verl,...

tests/test_extras.py imports every adapter in the test environment, each refusing the other
adapters' frameworks: torch (expbuf's own requirement, which every adapter imports, some 3 s of a
child's start) and SHARED, the libraries several frameworks load, are imported once, then each
adapter is imported in a process forked from that one, and a JSON object says what each printed
and how it exited. No framework is loaded before the fork (it checks), so each is still refused in
every child where it is named.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

from forks import forked

# Libraries that several of the frameworks load at their import, imported before the fork where
# installed rather than again in each child: the six imports took 35 s of CPU in all, 17 so.
# None of them loads a framework (import_each checks), so each is refused as before.
SHARED = ("tensordict", "ray", "datasets", "transformers.modeling_utils")


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
    if argv[1] == "--each":
        print(json.dumps(import_each(dict(arg.split("=", 1) for arg in argv[2:]))))
        return 0
    refused = {name for name in (argv[2] if len(argv) > 2 else "").split(",") if name}
    sys.meta_path.insert(0, NotInstalled(refused))
    names = import_all(argv[1])
    print(f"{argv[1]}: {len(names)} modules imported")
    return 0


def import_each(adapters: dict[str, str]) -> dict[str, dict[str, object]]:
    """Each adapter (module name to the frameworks it refuses, comma-separated) imported in a child
    forked from this process once torch and SHARED are loaded, one after another: each child's
    exit status, and what it printed."""
    import torch  # noqa: F401  (what every child would load first)

    for name in SHARED:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)

    frameworks = {name for refused in adapters.values() for name in refused.split(",") if name}
    loaded = sorted(frameworks & {name.partition(".")[0] for name in sys.modules})
    if loaded:
        raise SystemExit(f"loaded before the fork, so never refused: {', '.join(loaded)}")
    results: dict[str, dict[str, object]] = {}
    for adapter, refused in adapters.items():
        results[adapter] = forked(functools.partial(main, [sys.argv[0], adapter, refused]))
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv))
