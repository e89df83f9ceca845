"""Presets (client/schema/table_presets.py): the settings of the common tables, one definition each, the
same table from every entry point (TableConfig.preset, a TOML block, the clients, the sharded
client, the command line), the settings given over the preset's, and refusals that name what is
missing or unknown."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest

from expbuf.client import AsyncBufferClient, BufferClient
from expbuf.client.schema.table_presets import PRESETS
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.server import cli
from expbuf.server.commands.tables import run_client_command
from expbuf.server.config import load
from expbuf.server.store.schema.errors import ConfigError
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.schema.table_parts import Capacity, Grouping, RateLimiter

from pages import code_blocks, page


def test_each_preset_is_its_table() -> None:
    queue = TableConfig.preset("queue", "q", capacity_experiences=100)
    assert queue.capacity == Capacity(experiences=100, when_full="block")
    assert queue.reuse.max_times_sampled == 1
    replay = TableConfig.preset("replay", "r", capacity_experiences=10_000, min_size_to_sample=1000)
    assert replay.capacity == Capacity(experiences=10_000, when_full="evict")
    assert replay.reuse.max_times_sampled == 2
    # Acme's rule: a tenth of what the ratio asks of the first min_size_to_sample experiences.
    assert replay.rate_limiter == RateLimiter(min_size_to_sample=1000, samples_per_insert=2.0, error_buffer=200.0)
    trinity = TableConfig.preset("trinity", "grpo8", group_size=8)
    assert trinity.grouping == Grouping(by="task", size=8, on_timeout="release")
    assert trinity.advantages.estimator == "grpo"
    assert sorted(PRESETS) == ["queue", "replay", "trinity"]


def test_the_settings_given_win_over_the_presets() -> None:
    replay = TableConfig.preset(
        "replay", "r", capacity_experiences=100, min_size_to_sample=10, samples_per_insert=4.0, estimator="rloo"
    )
    assert (replay.rate_limiter.samples_per_insert, replay.rate_limiter.error_buffer) == (
        4.0,
        4.0,
    )  # at least the ratio
    assert replay.advantages.estimator == "rloo"
    unlimited = TableConfig.preset("replay", "r", capacity_experiences=100, min_size_to_sample=10, samples_per_insert=0)
    assert unlimited.rate_limiter == RateLimiter(min_size_to_sample=10)  # no ratio, no error band
    assert TableConfig.preset("queue", "q", capacity_experiences=8, when_full="evict").capacity.when_full == "evict"
    assert TableConfig.preset("trinity", "agent", group_size=0, estimator="step_wise_grpo").grouping.size == 0


def test_a_preset_without_what_it_needs_or_an_unknown_one_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^table 'q': table preset 'queue' needs capacity_experiences \(the most"):
        TableConfig.preset("queue", "q")
    with pytest.raises(ConfigError, match=r"needs capacity_experiences .* and min_size_to_sample"):
        TableConfig.preset("replay", "r")
    with pytest.raises(ConfigError, match=r"needs group_size \(the job's algorithm.repeat_times"):
        TableConfig.preset("trinity", "t")
    with pytest.raises(ConfigError, match=r"^table 't': unknown table preset 'fifo'; known: queue, replay, trinity$"):
        TableConfig.preset("fifo", "t")
    with pytest.raises(ConfigError, match="table 'q': when_full is 'blok'"):  # the preset's table is checked too
        TableConfig.preset("queue", "q", capacity_experiences=8, when_full="blok")  # type: ignore[typeddict-item]


def test_the_trinity_preset_is_the_table_the_trinity_page_has_a_job_create() -> None:
    blocks = [tomllib.loads(block)["tables"][0] for block in code_blocks(page("frameworks/trinity.md"), "toml")]
    (grpo8,) = (table for table in blocks if table["name"] == "grpo8")
    assert TableConfig.preset("trinity", "grpo8", group_size=grpo8["group_size"]) == TableConfig.from_settings(grpo8)


def test_a_toml_block_takes_a_preset_with_settings_beside_it(tmp_path: Path) -> None:
    toml = tmp_path / "expbuf.toml"
    (block,) = (b for b in code_blocks(page("concepts/tables.md"), "toml") if "preset" in b)
    toml.write_text(block)
    (table,) = load(str(toml)).tables
    assert table == TableConfig.preset("queue", "queue", capacity_experiences=50_000, estimator="rloo")
    (block,) = (b for b in code_blocks(page("operations/serving.md"), "toml") if "preset" in b)
    toml.write_text(block)
    (table,) = load(str(toml)).tables
    assert table == TableConfig.preset("replay", "replay", capacity_experiences=100_000, min_size_to_sample=1024)
    toml.write_text('[[tables]]\nname = "q"\npreset = "queue"\n')
    with pytest.raises(ConfigError, match="table 'q': table preset 'queue' needs capacity_experiences"):
        load(str(toml))


def test_every_client_and_the_command_line_expand_a_preset_into_the_same_table(
    start_server, capsys: pytest.CaptureFixture
) -> None:
    one, two = start_server(), start_server(data=start_server.data.parent / "two")
    want = TableConfig.preset("replay", "r", capacity_experiences=100, min_size_to_sample=10)
    target = f"127.0.0.1:{one.port}"
    with BufferClient(target, timeout=10) as client:
        made = client.create_table("r", preset="replay", capacity_experiences=100, min_size_to_sample=10)
        assert TableConfig.from_settings(made.settings()) == want == one.store.table("r")
        with pytest.raises(ValueError, match="unknown table preset 'fifo'; known: queue, replay, trinity"):
            client.create_table("f", preset="fifo")

    async def create_async() -> None:
        async with AsyncBufferClient(target, timeout=10) as client:
            await client.create_table("q", preset="queue", capacity_experiences=64)

    asyncio.run(create_async())
    assert one.store.table("q") == TableConfig.preset("queue", "q", capacity_experiences=64)
    with ShardedBufferClient([target, f"127.0.0.1:{two.port}"], timeout=10) as sharded:
        sharded.create_table("t", preset="trinity", group_size=8)
    assert one.store.table("t") == two.store.table("t") == TableConfig.preset("trinity", "t", group_size=8)
    parser = cli.build_parser()  # `expbuf table create` as the command line runs it
    args = ["table", "create", "cli", "capacity_experiences=100", "min_size_to_sample=10", "--preset", "replay"]
    assert run_client_command(parser.parse_args([*args, "--target", target]), None) == 0
    assert 'when_full = "evict"' in capsys.readouterr().out
    assert one.store.table("cli").settings() == {**want.settings(), "name": "cli"}
    with pytest.raises(SystemExit):  # argparse names the presets it knows
        parser.parse_args(["table", "create", "x", "--preset", "fifo"])
    assert "invalid choice: 'fifo' (choose from 'queue', 'replay', 'trinity')" in capsys.readouterr().err
