"""Import paths the docs gave before these modules moved (into the storage engine, then into the
rooms) still work for one release: each name is the moved module's own, read with a
DeprecationWarning that names the new path and points at the line that read it
(client/moved.py). Nothing of expbuf's own reads an old path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

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


def test_an_old_path_without_a_file_imports_in_a_fresh_interpreter() -> None:
    """The order registry's old paths are no files: the store's package serves them (an alias,
    client/moved.py) as the import system loads it, before it looks for the old path."""
    code = (
        "from expbuf.server.store.schema.ready_indexes import KeyedIndex\n"
        "import expbuf.server.store.selection as old\n"
        "import expbuf.server.store as store\n"
        "print(KeyedIndex is store.KeyedIndex, old.register is store.register)\n"
    )
    done = python(code, warnings="always::DeprecationWarning")
    assert done.returncode == 0 and done.stdout == "True True\n", done.stderr[-3000:]
    assert "expbuf.server.store.schema.ready_indexes moved to expbuf.server.store: import KeyedIndex" in done.stderr


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
