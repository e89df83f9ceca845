"""No test module imports a framework at its import: every pytest-xdist worker collects every
module, and the frameworks' imports at the top of 29 of them cost each worker 9 s of CPU before
its first test. A module imports them in its `import_frameworks()`, which tests/conftest.py runs
before its tests; what a module imports at its top from another test module counts as its own."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).parent
# The frameworks' packages and what loads them: expbuf's adapters, and the packages that are
# theirs to bring (tensordict, transformers, kubernetes: seconds each).
FRAMEWORKS = {
    "areal", "datasets", "kubernetes", "openai", "peft", "ray", "tensordict", "torchrl", "transfer_queue",
    "transformers", "trinity", "trl", "verl",
}  # fmt: skip
ADAPTERS = ("expbuf.client.areal", "expbuf.client.torchrl", "expbuf.client.transferqueue", "expbuf.client.trinity",
            "expbuf.client.trl", "expbuf.client.verl", "expbuf.ray")  # fmt: skip


@functools.cache
def imported_at_top(source: str) -> tuple[str, ...]:
    """The modules a module's source imports as it is imported (function bodies and TYPE_CHECKING
    blocks aside), with the packages its top-level `pytest.importorskip` calls import. Cached: the
    helpers every module imports were parsed again for each (21 s of the suite on 2 cores)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.importorskip" and node.args:
            names.append(ast.literal_eval(node.args[0]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return tuple(names)


def frameworks_at_top(source: str, local: dict[str, Path], seen: frozenset[str] = frozenset()) -> set[str]:
    """What of FRAMEWORKS and ADAPTERS importing this source loads, through the local modules it imports too."""
    found = set()
    for name in imported_at_top(source):
        root = name.split(".")[0]
        if root in FRAMEWORKS or name.startswith(ADAPTERS):
            found.add(name)
        elif root in local and root not in seen:
            found |= {f"{root} -> {f}" for f in frameworks_at_top(local[root].read_text(), local, seen | {root})}
    return found


def test_no_test_module_imports_a_framework_at_its_import() -> None:
    local = {path.stem: path for path in [*TESTS.glob("*.py"), *TESTS.glob("faults/*.py")]}
    found = {
        str(path.relative_to(TESTS)): sorted(frameworks_at_top(path.read_text(), local))
        for path in local.values()
        if path.name.startswith("test_")
    }
    assert {module: names for module, names in found.items() if names} == {}


def test_a_framework_imported_at_the_top_or_through_a_local_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "shared.py").write_text("import pytest\n\ntd = pytest.importorskip('tensordict')\n")
    local = {"shared": tmp_path / "shared.py"}
    source = (
        "import torch\nfrom expbuf.client.trl.leases import LeaseBook\nimport shared\n\n\ndef f():\n    import verl\n"
    )
    assert frameworks_at_top(source, local) == {"expbuf.client.trl.leases", "shared -> tensordict"}
    assert frameworks_at_top("from trinity.common.experience import EID\n", {}) == {"trinity.common.experience"}
