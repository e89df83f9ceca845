"""Import paths the docs gave before these modules moved (into the storage engine, then into the
rooms) still work for one release: each name is the moved module's own, read with a
DeprecationWarning that names the new path and points at the line that read it
(client/moved.py). They are served from one table per side, with no file each: no module under
server/ or client/ is a shim. Nothing of expbuf's own reads an old path."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import expbuf.client
import expbuf.server

# The old path, the new one, and the names the docs told users to import from the old one.
MOVED = [
    (
        "expbuf.server.estimator_registry",
        "expbuf.server.store.schema.estimator_registry",
        ["Estimator", "Param", "register"],
    ),
    ("expbuf.server.ready_indexes", "expbuf.server.store", ["KeyedIndex", "u64", "version_key"]),
    ("expbuf.server.selection", "expbuf.server.store", ["Order", "register"]),
    ("expbuf.server.store.selection", "expbuf.server.store", ["Order", "register"]),
    ("expbuf.server.store.schema.selection", "expbuf.server.store", ["Order", "register", "ReadyIndex"]),
    ("expbuf.server.store.estimator_registry", "expbuf.server.store.schema.estimator_registry", ["register"]),
    ("expbuf.server.store.ready_indexes", "expbuf.server.store", ["KeyedIndex"]),
    ("expbuf.server.store.schema.ready_indexes", "expbuf.server.store", ["KeyedIndex", "Index", "u64", "version_key"]),
    ("expbuf.server.store.table_config", "expbuf.server.store.schema.table_config", ["TableConfig"]),
    ("expbuf.server.store.table_parts", "expbuf.server.store.schema.table_parts", ["Shaping"]),
    ("expbuf.server.store.errors", "expbuf.server.store.schema.errors", ["StoreError"]),
    ("expbuf.server.store.states", "expbuf.server.store.schema.states", ["State"]),
    ("expbuf.server.store.sample_spec", "expbuf.server.store.schema.sample_spec", ["TakeSpec"]),
    ("expbuf.server.store.stored_advantages", "expbuf.server.store.disk.stored_advantages", ["FinishBatch"]),
    ("expbuf.server.estimators", "expbuf.server.advantages.estimators", ["FlatBatch"]),
    ("expbuf.server.batch_stage", "expbuf.server.advantages.batch_stage", ["finish_batch"]),
    ("expbuf.server.shaping", "expbuf.server.advantages.shaping", ["shape"]),
    ("expbuf.server.rpc.stalled_sends", "expbuf.server.rpc.sample.stalled_sends", ["SNAPSHOT_SECONDS"]),
    ("expbuf.client.experience", "expbuf.client.schema.experience", ["Experience", "EID"]),
    ("expbuf.client.prompts", "expbuf.client.schema.prompts", ["Claim", "MAX_PROMPTS_PER_CALL"]),
    ("expbuf.client.routing", "expbuf.client.schema.routing", ["ShardMap", "rendezvous"]),
    ("expbuf.client.table_presets", "expbuf.client.schema.table_presets", ["preset_settings"]),
    ("expbuf.client.table_settings", "expbuf.client.schema.table_settings", ["TableSettings"]),
    ("expbuf.client.sample_spec", "expbuf.client.rpc.sample_spec", ["SampleSpec"]),
    ("expbuf.client.wire", "expbuf.client.rpc.wire", ["param_number"]),
    ("expbuf.client.sharded", "expbuf.client.shards.blocking", ["ShardedBufferClient", "AsyncShardedBufferClient"]),
    ("expbuf.client.lease_keeper", "expbuf.client.kit.lease_keeper", ["LeaseKeeper", "RENEWALS_PER_LEASE"]),
    ("expbuf.client.location", "expbuf.client.kit.location", ["Location", "parse"]),
    ("expbuf.client.trxp.columns", "expbuf.client.trxp.stored.columns", ["FIELDS"]),
]


@pytest.mark.parametrize(("old", "new", "names"), MOVED)
def test_an_old_path_reads_the_moved_module_with_a_warning(old: str, new: str, names: list[str]) -> None:
    module, moved = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = getattr(module, name)
        assert found is getattr(moved, name)
        assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]
        said = f"{old} moved to {new}: import {name} from there ({old} goes in the next release)"
        assert str(caught[0].message) == said
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_tables_serve_the_old_paths_tested_here() -> None:
    """One table per side, {old path: new module}: each old path it serves is one of MOVED's,
    with the same new module, and each of MOVED's is served."""
    served = {**expbuf.client.OLD_PATHS, **expbuf.server.OLD_PATHS}
    assert served == {old: new for old, new, _ in MOVED}


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (
            "from expbuf.server.store.schema.ready_indexes import KeyedIndex\n"
            "import expbuf.server.store.selection as old\n"
            "import expbuf.server.store as store\n"
            "print(KeyedIndex is store.KeyedIndex, old.register is store.register)\n",
            "<string>:1: DeprecationWarning: expbuf.server.store.schema.ready_indexes moved to expbuf.server.store: "
            "import KeyedIndex from there",
        ),
        (
            "import expbuf.server.selection\n"
            "import expbuf.server.store as store\n"
            "print(expbuf.server.selection.Order is store.Order, 'selection' in dir(expbuf.server))\n",
            "<string>:3: DeprecationWarning: expbuf.server.selection moved to expbuf.server.store: import Order",
        ),
        (
            "from expbuf.client.sample_spec import SampleSpec\n"
            "import expbuf.client as client\n"
            "print(SampleSpec is client.rpc.sample_spec.SampleSpec, 'sample_spec' in dir(client))\n",
            "<string>:1: DeprecationWarning: expbuf.client.sample_spec moved to expbuf.client.rpc.sample_spec: "
            "import SampleSpec from there",
        ),
    ],
)
def test_an_old_path_imports_in_a_fresh_interpreter(code: str, said: str) -> None:
    """An old path has no file: the table its side's package handed to client/moved.py as the
    import system loaded that package, before it looked for the old path, serves it (and, as
    for any module, puts it in its package)."""
    done = python(code, warnings="always::DeprecationWarning")
    assert done.returncode == 0 and done.stdout == "True True\n", done.stdout + done.stderr[-3000:]
    assert said in done.stderr, done.stderr[-3000:]


def test_an_old_path_imports_its_new_module_only_when_it_is_imported() -> None:
    """The tables name the new modules: importing the server and the client loads none of them
    (nor torch, which the advantages' modules import), an old path loads its own."""
    code = (
        "import sys, expbuf.server, expbuf.client\n"
        "heavy = ('torch', 'grpc', 'expbuf.server.advantages', 'expbuf.server.store', 'expbuf.client.shards')\n"
        "print(sorted(name for name in sys.modules if name.startswith(heavy)))\n"
        "import expbuf.server.shaping\n"
        "print('expbuf.server.advantages.shaping' in sys.modules)\n"
    )
    done = python(code, warnings="error::DeprecationWarning")
    assert done.returncode == 0 and done.stdout == "[]\nTrue\n", done.stdout + done.stderr[-3000:]


def is_shim(source: str) -> bool:
    """Whether a module only forwards names: its statements (but its docstring) are imports and
    an assignment of the module `__getattr__`."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    forwards = [
        statement
        for statement in body
        if isinstance(statement, ast.Assign)
        and [target.id for target in statement.targets if isinstance(target, ast.Name)] == ["__getattr__"]
    ]
    rest = [statement for statement in body if not isinstance(statement, ast.Import | ast.ImportFrom)]
    return bool(forwards) and rest == forwards


ROOT = Path(__file__).resolve().parent.parent


def test_no_module_is_a_shim() -> None:
    """No file under server/ or client/ exists only to forward a moved module's names: the old
    paths are the tables' (client/moved.py)."""
    shims = [
        str(path.relative_to(ROOT))
        for folder in ("server", "client")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if is_shim(path.read_text())
    ]
    assert shims == []


def test_a_shim_is_seen_as_one() -> None:
    """The check above finds the form the old paths' files had, and not a module that does more."""
    shim = '"""Deprecated."""\n\nfrom .moved import moved\nfrom .rpc import wire\n\n'
    shim += "__getattr__ = moved(__name__, wire)\n"
    assert is_shim(shim)
    assert not is_shim(shim + "\nLIMIT = 3\n")
    assert not is_shim('"""A package."""\n\nfrom .a import b\n')


# What a user's process imports: the server, the store, the client and every adapter.
ENTRY_POINTS = [
    "expbuf.server.app",
    "expbuf.server.cli",
    "expbuf.server.store",
    "expbuf.client",
    "expbuf.client.shards.blocking",
    "expbuf.client.pushers.aio",
    "expbuf.client.torch",
    "expbuf.client.trinity",
    "expbuf.client.verl",
    "expbuf.client.areal",
    "expbuf.client.trl",
    "expbuf.client.torchrl",
    "expbuf.ray",
]


def test_nothing_of_expbufs_own_reads_an_old_path() -> None:
    """Every module of the server, the store, the client and the adapters imported in a fresh
    interpreter, with expbuf's own deprecation warnings made errors: none is raised."""
    code = "; ".join([*(f"import {name}" for name in ENTRY_POINTS), "from expbuf.client import *"])
    done = python(code, warnings="error:expbuf.:DeprecationWarning")
    assert done.returncode == 0, done.stderr[-3000:]


def python(code: str, *, warnings: str) -> subprocess.CompletedProcess[str]:
    """`code` run by a fresh interpreter under the warnings filter given."""
    command = [sys.executable, "-W", warnings, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
