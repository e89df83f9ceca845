"""A table's configuration composed of typed parts (server/store/schema/table_parts.py): each part checks
its own ranges, the flat settings map to the parts and back through one mapping, mypy sees a
mistyped mode, the flat keywords of earlier releases still work with a DeprecationWarning, and an
old client's CreateTable (flat fields only) creates the same table as before."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest
import typecheck
from mypy import api

from expbuf.client.rpc.wire import table_from_proto
from expbuf.client.schema.table_settings import SETTING_NAMES, TableSettings
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.store.schema.errors import ConfigError
from expbuf.server.store.schema.table_config import HIDDEN_WHERE, OWN, PARTS, WHERE, TableConfig, differences
from expbuf.server.store.schema.table_parts import (
    Capacity,
    Estimation,
    Grouping,
    RateLimiter,
    Reuse,
    Shaping,
    Staleness,
    Storage,
    flat_names,
    is_hidden,
)

from pages import code_blocks, page

A_TABLE: TableSettings = {
    "group_by": "run",
    "group_size": 4,
    "group_timeout_seconds": 30.0,
    "on_group_timeout": "drop",
    "estimator": "opmd",
    "estimator_params": {"tau": 0.5, "opmd_baseline": "logavgexp"},
    "device": "cpu",
    "capacity_experiences": 1000,
    "capacity_bytes": 1 << 30,
    "when_full": "evict",
    "max_times_sampled": 3,
    "drop_zero_variance": True,
    "tombstone_seconds": 60.0,
    "keep_failed": False,
    "shaping": {"reward_clip": 5.0, "advantage_clip": 2.0},
    "max_staleness": 2,
    "batch_size": 64,
    "on_stale": "refuse",
    "min_size_to_sample": 8,
    "samples_per_insert": 2.0,
    "samples_per_insert_error": 4.0,
    "evict_stale": True,
    "priority_decay": 1.0,
    "reuse_cooldown_seconds": 5.0,
    "priority_noise": 0.1,
    "extensions": ["journal"],
    "min_group_size": 3,
    "max_token_staleness": 1,
    "on_token_stale": "drop",
    "compression": "zstd",
    "compression_level": 5,
}


def test_every_flat_setting_is_one_field_of_one_part() -> None:
    shown = [(cls, f) for cls in PARTS.values() for f in dataclasses.fields(cls) if not is_hidden(f)]
    owned = [*(flat_names(cls)[f.name] for cls, f in shown), *OWN]
    assert sorted(owned) == sorted(SETTING_NAMES) and len(set(owned)) == len(owned)
    assert list(WHERE) == list(SETTING_NAMES)
    assert set(A_TABLE) == set(SETTING_NAMES)  # the test's table sets every one


def test_a_tables_layout_is_a_hidden_setting_kept_with_the_table_and_off_the_wire() -> None:
    """storage.layout (issue 64's rows, while they land): set from Python or a TOML file's table,
    stored with the table and read back, refused out of its values, but not among the flat
    settings the wire, `settings()` and the settings page carry; a records table is stored as
    before, so a release without the setting still opens it."""
    assert HIDDEN_WHERE == {"layout": ("storage", "layout")}
    rows = TableConfig("t", storage=Storage(layout="rows"))
    assert TableConfig.from_settings({"name": "t", "layout": "rows"}) == rows
    assert "layout" not in rows.settings() and "layout" not in SETTING_NAMES
    assert rows.to_stored()["layout"] == "rows" and TableConfig.from_stored(rows.to_stored()) == rows
    records = TableConfig("t", storage=Storage(layout="records"))
    assert "layout" not in records.to_stored() and TableConfig.from_stored(records.to_stored()) == records
    with pytest.raises(ConfigError, match="layout is 'columns'; expected one of records, rows"):
        TableConfig.from_settings({"name": "t", "layout": "columns"})


@pytest.mark.parametrize("default", ["records", "rows"])
def test_the_default_layout_is_the_environments_and_a_stored_table_keeps_its_own(
    default: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EXPBUF_DEFAULT_LAYOUT (`pytest --layout`) sets the layout of a table created without one; a
    stored table that names none is a records table whatever the default, and a rows table is
    stored naming it, so a directory reads the same under either default."""
    monkeypatch.setenv("EXPBUF_DEFAULT_LAYOUT", default)
    assert TableConfig("t").storage.layout == default
    assert TableConfig.from_stored({"name": "t"}).storage.layout == "records"
    for layout in ("records", "rows"):
        stored = TableConfig("t", storage=Storage(layout=layout)).to_stored()
        assert ("layout" in stored) == (layout == "rows")
        monkeypatch.setenv("EXPBUF_DEFAULT_LAYOUT", "rows" if default == "records" else "records")
        assert TableConfig.from_stored(stored).storage.layout == layout
        monkeypatch.setenv("EXPBUF_DEFAULT_LAYOUT", default)


def test_flat_settings_become_parts_and_come_back() -> None:
    config = TableConfig.of("t", **A_TABLE)
    assert config.grouping == Grouping(
        by="run", size=4, timeout_seconds=30.0, on_timeout="drop", drop_zero_variance=True, min_size=3
    )
    assert config.capacity == Capacity(experiences=1000, bytes=1 << 30, when_full="evict")
    assert config.rate_limiter == RateLimiter(min_size_to_sample=8, samples_per_insert=2.0, error_buffer=4.0)
    assert config.reuse == Reuse(max_times_sampled=3, priority_decay=1.0, cooldown_seconds=5.0, priority_noise=0.1)
    assert config.staleness == Staleness(
        max_staleness=2,
        batch_size=64,
        on_stale="refuse",
        evict_stale=True,
        max_token_staleness=1,
        on_token_stale="drop",
    )
    assert config.storage == Storage(compression="zstd", compression_level=5)
    assert config.advantages.params == {"tau": 0.5, "opmd_baseline": 1.0}  # a choice by its position
    assert config.advantages.shaping == Shaping(reward_clip=5.0, advantage_clip=2.0)
    settings = config.settings()
    assert list(settings) == ["name", *SETTING_NAMES]
    assert TableConfig.from_settings(settings) == config
    assert TableConfig.from_stored(config.to_stored()) == config
    built = TableConfig(
        "t",
        grouping=config.grouping,
        advantages=Estimation(
            "opmd", {"tau": 0.5, "opmd_baseline": "logavgexp"}, "cpu", Shaping(5.0, advantage_clip=2)
        ),
        capacity=config.capacity,
        retention=config.retention,
        staleness=config.staleness,
        rate_limiter=config.rate_limiter,
        reuse=config.reuse,
        storage=config.storage,
        extensions=("journal",),
    )
    assert built == config and differences(built, config) == []
    assert differences(TableConfig("t"), config)[0] == "group_by: the table has 'task', the request 'run'"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Capacity(when_full="blok"), "when_full is 'blok'; expected one of block, evict"),  # type: ignore[arg-type]
        (lambda: Grouping(size=-1), "group_size must be an integer from 0 to 1048576, got -1"),
        (lambda: Grouping(by="none", size=2), "group_size must be 0 or 1 when group_by is 'none'"),
        (lambda: Grouping(timeout_seconds=float("inf")), "group_timeout_seconds must be from 0 to"),
        (lambda: RateLimiter(samples_per_insert=2.0, error_buffer=1.0), "samples_per_insert_error is 1; with"),
        (lambda: Reuse(priority_noise=1.0), "priority_noise is added to a replayed group's lowered priority"),
        (lambda: Staleness(evict_stale=1), "evict_stale must be true or false, got 1"),  # type: ignore[arg-type]
        (lambda: Storage(compression="lz4"), "compression is 'lz4'; expected one of none, zstd"),  # type: ignore[arg-type]
        (lambda: Storage(compression_level=True), "compression_level must be an integer from 1 to 19, got True"),
        (lambda: Estimation("none", shaping=Shaping(reward_clip=1.0)), "shaping reward_clip needs an estimator"),
    ],
)
def test_each_part_refuses_its_own_settings_by_their_flat_names(make, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make()


def test_a_refusal_from_flat_settings_names_the_table() -> None:
    with pytest.raises(ConfigError, match=r"^table 't': when_full is 'blok'; expected one of block, evict$"):
        TableConfig.of("t", when_full="blok")  # type: ignore[typeddict-item]
    with pytest.raises(ConfigError, match=r"^unknown table setting\(s\): group_sise$"):
        TableConfig.from_settings({"name": "t", "group_sise": 8})
    with pytest.raises(ConfigError, match="expected a Capacity"):
        TableConfig("t", capacity={"experiences": 8})  # type: ignore[arg-type]


def test_flat_keywords_and_attributes_of_earlier_releases_warn_for_one_release() -> None:
    with pytest.warns(DeprecationWarning, match=r"TableConfig.of\(name, \*\*settings\)"):
        old = TableConfig(name="t", group_size=8, estimator="none")
    assert old == TableConfig.of("t", group_size=8, estimator="none")
    with pytest.warns(DeprecationWarning, match=r"read config.grouping.size"):
        assert old.group_size == 8
    with pytest.warns(DeprecationWarning, match=r"use settings\(\)"):
        assert old.to_dict() == old.settings()
    with pytest.warns(DeprecationWarning, match=r"use from_settings\(\)"):
        assert TableConfig.from_dict(old.settings()) == old
    with pytest.raises(AttributeError, match="group_sise"):
        old.group_sise  # noqa: B018
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="parts or flat settings, not both"):
        TableConfig("t", grouping=Grouping(), when_full="evict")
    assert dataclasses.replace(old, capacity=Capacity(experiences=4)).capacity.experiences == 4


def test_mypy_sees_a_mistyped_mode_or_setting(tmp_path: Path) -> None:
    """As tests/typecheck.py runs it, over a snippet of user code."""
    snippet = tmp_path / "user_code.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from expbuf.client import AsyncBufferClient, BufferClient
            from expbuf.client.shards.blocking import ShardedBufferClient
            from expbuf.server.store.schema.table_config import TableConfig
            from expbuf.server.store.schema.table_parts import Capacity

            def make(client: BufferClient, sharded: ShardedBufferClient) -> None:
                client.create_table("t", group_size=8, when_full="evict", shaping={"reward_clip": 5.0})
                client.create_table("t", when_full="blok")
                sharded.create_table("t", group_sise=8)

            async def make_async(client: AsyncBufferClient) -> None:
                await client.create_table("t", group_by="episode")

            TableConfig.of("t", on_stale="ignore")
            Capacity(when_full="blok")
            """
        )
    )
    typecheck.lay_out_links()
    cwd = Path.cwd()
    os.chdir(typecheck.ROOT)
    try:
        out, _, status = api.run([str(snippet)])
    finally:
        os.chdir(cwd)
    errors = [line.split(": error: ")[1] for line in out.splitlines() if ": error: " in line]
    assert status == 1 and len(errors) == 5, out
    assert 'Argument "when_full" to "create_table" of "BufferClient" has incompatible type "Literal[\'blok\']"' in out
    assert 'Unexpected keyword argument "group_sise" for "create_table" of "ShardedBufferClient"' in out
    assert '"group_by" to "create_table" of "AsyncBufferClient" has incompatible type "Literal[\'episode\']"' in out
    assert 'Argument "on_stale" to "of" of "TableConfig" has incompatible type "Literal[\'ignore\']"' in out
    assert 'Argument "when_full" to "Capacity" has incompatible type "Literal[\'blok\']"' in out


def test_an_old_clients_create_table_makes_the_table_it_always_did(stub, server) -> None:
    """A CreateTable message as a client of an earlier release builds it: flat fields, none of
    the newer ones; the table is the one its settings describe."""
    old = pb.TableConfig(
        name="old",
        group_by=pb.GROUP_BY_RUN,
        group_size=4,
        on_group_timeout=pb.ON_GROUP_TIMEOUT_DROP,
        estimator=pb.Estimator(name="rloo", device="cpu"),
        capacity_experiences=100,
        when_full=pb.WHEN_FULL_EVICT,
        max_times_sampled=2,
        keep_failed=False,
        shaping=pb.Shaping(reward_clip=5.0),
        max_staleness=3,
        samples_per_insert=1.0,
        samples_per_insert_error=2.0,
    )
    reply = stub.CreateTable(pb.CreateTableRequest(config=old), timeout=10)
    want = TableConfig.of(
        "old",
        group_by="run",
        group_size=4,
        on_group_timeout="drop",
        estimator="rloo",
        device="cpu",
        capacity_experiences=100,
        when_full="evict",
        max_times_sampled=2,
        keep_failed=False,
        shaping={"reward_clip": 5.0},
        max_staleness=3,
        samples_per_insert=1.0,
        samples_per_insert_error=2.0,
    )
    assert reply.created and server.store.table("old") == want
    assert table_from_proto(reply.config) == want.settings()
    listed = stub.ListTables(pb.ListTablesRequest(), timeout=10).tables
    assert [table_from_proto(t) for t in listed if t.name == "old"] == [table_from_proto(reply.config)]


def test_the_parts_example_of_the_tables_page_runs() -> None:
    exec(code_blocks(page("concepts/tables.md"), "python")[0], {})
