"""Trinity-RFT jobs against expbuf, driven by Trinity's own classes: multi-step workflows,
pipeline filters, end of data across processes, exact batch sizes, Trinity's buffer settings,
its priority queue with reuse, and the scenarios of Trinity's tests/buffer/queue_test.py and
sql_test.py (skipped where trinity-rft is not installed)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
import yaml

from expbuf.client import BufferClient
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import scrape
from pages import code_blocks, page
from test_trinity_plugin import plugin  # noqa: F401 - loads the plugin as Trinity does, for this module too


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity, OmegaConf, GRPOGroupedAdvantage, StepWiseGRPOAdvantageFn, DefaultSampleStrategy
    global create_operators, ExperiencePipeline, QueueStorage, Config, ExperienceBufferConfig, OperatorConfig
    global ReplayBufferConfig, TasksetConfig, load_config, EID, Experience, plugin_dir
    import test_trinity_plugin

    test_trinity_plugin.import_frameworks()
    trinity = pytest.importorskip("trinity")
    from omegaconf import OmegaConf
    from trinity.algorithm.advantage_fn.grpo_advantage import GRPOGroupedAdvantage
    from trinity.algorithm.advantage_fn.multi_step_grpo_advantage import StepWiseGRPOAdvantageFn
    from trinity.algorithm.sample_strategy.sample_strategy import DefaultSampleStrategy
    from trinity.buffer.operators.experience_operator import create_operators
    from trinity.buffer.pipelines.experience_pipeline import ExperiencePipeline
    from trinity.buffer.storage.queue import QueueStorage
    from trinity.common.config import (
        Config,
        ExperienceBufferConfig,
        OperatorConfig,
        ReplayBufferConfig,
        TasksetConfig,
        load_config,
    )
    from trinity.common.experience import EID, Experience

    from expbuf.client.trinity import plugin_dir


TABLE = "jobs"


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server()


Table = Callable[..., dict]


@pytest.fixture
def table(server: ExpbufServer) -> Table:
    def create(**settings: object) -> dict:
        with BufferClient(f"127.0.0.1:{server.port}") as admin:
            return admin.create_table(TABLE, **settings)

    return create


def buffer_config(server: ExpbufServer, batch_size: int, query: str = "", **settings: object) -> ExperienceBufferConfig:
    path = f"expbuf://127.0.0.1:{server.port}/{TABLE}" + (f"?{query}" if query else "")
    settings = {"max_read_timeout": 5.0, **settings}  # a missing batch fails the test, not hangs it
    return ExperienceBufferConfig(name="experience_buffer", path=path, batch_size=batch_size, **settings)


def multi_step(task: int, rewards: list[float], steps: list[int], batch: int = 2) -> list[Experience]:
    """One task of a step-wise workflow: run r takes steps[r] steps; its last step carries its reward."""
    return [
        Experience(
            eid=EID(batch=batch, task=task, run=run, step=step),
            tokens=torch.arange(8, dtype=torch.int32),
            prompt_length=3,
            logprobs=torch.full((5,), -0.25),
            action_mask=torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool),
            reward=reward if step == count - 1 else 0.0,
            info={"model_version": 1},
        )
        for run, (reward, count) in enumerate(zip(rewards, steps, strict=True))
        for step in range(count)
    ]


def single_turn(task: int, rewards: list[float], version: int = 1) -> list[Experience]:
    return [
        Experience(
            eid=EID(batch=5, task=task, run=run),
            tokens=torch.arange(6, dtype=torch.int32),
            prompt_length=2,
            logprobs=torch.full((4,), -0.5),
            reward=reward,
            info={"model_version": version},
        )
        for run, reward in enumerate(rewards)
    ]


def write(config: ExperienceBufferConfig, *writes: list[Experience], release: bool = True) -> None:
    async def run() -> None:
        writer = trinity.buffer.get_buffer_writer(config)
        await writer.acquire()
        for data in writes:
            await writer.write(data)
        if release:
            await writer.release()

    asyncio.run(run())
    computed(config)


def computed(config: ExperienceBufferConfig) -> None:
    """Wait until the written groups' advantages are computed: a push returns once its
    experiences are stored, before that, and a read in priority order must see them all."""
    match = re.match(r"expbuf://([^/]+)/(\w+)", config.path)
    if match is None:
        return
    with BufferClient(match.group(1)) as client:
        deadline = time.monotonic() + 30
        while client.stats(match.group(2))[match.group(2)].groups_computing and time.monotonic() < deadline:
            time.sleep(0.02)


def by_uid(exps: list[Experience]) -> dict[str, Experience]:
    return {exp.eid.uid: exp for exp in exps}


def assert_advantages(read: list[Experience], want: list[Experience]) -> None:
    expected = by_uid(want)
    assert sorted(expected) == sorted(e.eid.uid for e in read)
    for exp in read:
        torch.testing.assert_close(exp.advantages, expected[exp.eid.uid].advantages.float(), atol=1e-5, rtol=1e-5)


# ---- multi-step workflows ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "trinity_fn"), [("step_wise_grpo", "StepWiseGRPOAdvantageFn"), ("grpo", "GRPOGroupedAdvantage")]
)
def test_multi_step_runs_are_written_whole_and_get_trinitys_advantages(
    server: ExpbufServer, table: Table, estimator: str, trinity_fn: str
) -> None:
    """4 runs x 1-3 steps per task, one explorer write: group_size = 0 completes each task's
    group when the write is stored, whatever the runs' step counts."""
    table(group_size=0, estimator=estimator)
    pushed = multi_step(0, [1.0, 0.0, 2.0, 0.5], [3, 3, 3, 3]) + multi_step(1, [0.0, 1.0, 3.0, 1.0], [1, 2, 3, 2])
    write(buffer_config(server, 16), pushed)
    fn = {"StepWiseGRPOAdvantageFn": StepWiseGRPOAdvantageFn, "GRPOGroupedAdvantage": GRPOGroupedAdvantage}[trinity_fn]
    want, _ = fn().process(copy.deepcopy(pushed))
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 16))
    first = asyncio.run(reader.read())
    assert [e.eid.tid for e in first] == ["2/0"] * 12  # task 1's 8 experiences do not fit next to these 12
    second = asyncio.run(reader.read())
    assert [e.eid.tid for e in second] == ["2/1"] * 8
    assert_advantages(first + second, want)


def test_multi_step_write_into_a_table_counting_runs_is_refused_with_what_to_set(
    server: ExpbufServer, table: Table
) -> None:
    table(group_size=4, estimator="step_wise_grpo")
    with pytest.raises(ValueError, match=r"12 more would overfill it.*create the table with group_size = 0"):
        write(buffer_config(server, 4), multi_step(0, [1.0, 0.0, 2.0, 0.5], [3, 3, 3, 3]))
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.stats(TABLE)[TABLE].pushed == 0  # nothing of the refused write is stored


def test_a_group_split_over_two_writes_is_refused_with_why(server: ExpbufServer, table: Table) -> None:
    table(group_size=0, estimator="grpo")
    runs = single_turn(0, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"group 5/0 is already complete.*came in two writes.*write every run"):
        write(buffer_config(server, 4), runs[:2], runs[2:])


# ---- pipeline filters ---------------------------------------------------------------------------


def pipeline_config(server: ExpbufServer, batch_size: int, operators: list[OperatorConfig]) -> Config:
    config = Config()
    config.algorithm.algorithm_type, config.algorithm.advantage_fn = "grpo", "expbuf"
    config.algorithm.advantage_fn_args = {}
    config.data_processor.experience_pipeline.save_input = False
    config.data_processor.experience_pipeline.operators = operators
    config.buffer.trainer_input.experience_buffer = buffer_config(server, batch_size)
    return config


async def run_pipeline(config: Config, *writes: list[Experience], close: bool = True) -> list[dict]:
    """Trinity's ExperiencePipeline as its prepare() sets it up, without auxiliary models."""
    pipeline = ExperiencePipeline(config)
    await pipeline.output.acquire()
    pipeline.operators = create_operators(config.data_processor.experience_pipeline.operators, {})
    pipeline._set_algorithm_operators(config.algorithm)
    metrics = [await pipeline.process(Experience.serialize_many(data)) for data in writes]
    if close:
        await pipeline.close()
    return metrics


@pytest.mark.parametrize("group_size", [4, 0])
def test_runs_a_reward_filter_dropped_are_not_waited_for(server: ExpbufServer, table: Table, group_size: int) -> None:
    """Trinity's reward_filter drops runs below 0.5: each write's groups are complete when it
    ends, and the trainer reads them at once, with the explorer still running."""
    table(group_size=group_size, estimator="grpo")
    config = pipeline_config(server, 4, [OperatorConfig(name="reward_filter", args={"threshold": 0.5})])
    pushed = single_turn(0, [1.0, 0.0, 2.0, 0.25]) + single_turn(1, [3.0, 1.0, 2.0, 4.0])
    metrics = asyncio.run(run_pipeline(config, pushed, close=False))
    assert metrics[0]["experience_pipeline/filtered_count"] == 2.0
    strategy = DefaultSampleStrategy(config.buffer)
    kept = [e for e in pushed if e.reward >= 0.5]
    batches = [asyncio.run(strategy.sample(step=1))[0], asyncio.run(strategy.sample(step=2))[0]]
    assert sorted(len(b) for b in batches) == [2, 4]
    want, _ = GRPOGroupedAdvantage().process(copy.deepcopy(kept))
    assert_advantages(batches[0] + batches[1], want)


# ---- end of data ----------------------------------------------------------------------------------

EXPLORER = textwrap.dedent(
    """
    import asyncio, sys, torch
    from trinity.buffer.pipelines.experience_pipeline import ExperiencePipeline
    from trinity.common.config import Config, ExperienceBufferConfig
    from trinity.common.experience import EID, Experience

    config = Config()
    config.mode = "both"
    config.algorithm.algorithm_type, config.algorithm.advantage_fn = "grpo", "expbuf"
    config.algorithm.advantage_fn_args = {}
    config.data_processor.experience_pipeline.save_input = False
    config.buffer.trainer_input.experience_buffer = ExperienceBufferConfig(name="experience_buffer", path=sys.argv[1])

    async def main():
        pipeline = ExperiencePipeline(config)  # loads the plugin from TRINITY_PLUGIN_DIRS
        await pipeline.output.acquire()
        pipeline.operators = []
        pipeline._set_algorithm_operators(config.algorithm)
        exps = [Experience(eid=EID(batch=1, task=t, run=r), tokens=torch.arange(5), prompt_length=2,
                           reward=float(r), info={"model_version": 0}) for t in range(2) for r in range(2)]
        await pipeline.process(Experience.serialize_many(exps))
        print("written", flush=True)
        sys.stdin.readline()  # the test says when the explorer finishes
        await pipeline.close()
        print("released", flush=True)

    asyncio.run(main())
    """
)


def said(process: subprocess.Popen, word: str) -> bool:
    """Whether the process printed `word` on a line of its own before ending (Trinity logs to stdout too)."""
    return any(line.strip() == word for line in iter(process.stdout.readline, ""))


def test_mode_both_trainer_ends_when_the_explorer_in_another_process_releases(
    server: ExpbufServer, table: Table
) -> None:
    """The explorer's pipeline runs in its own process, as Trinity's Ray actors do: its release
    reaches the server, and the trainer waiting for its next batch gets StopAsyncIteration."""
    table(group_size=2, estimator="grpo")
    config = Config()
    config.mode = "both"
    config.buffer.trainer_input.experience_buffer = buffer_config(server, 2, max_read_timeout=60.0)
    path = config.buffer.trainer_input.experience_buffer.path
    env = {**os.environ, "TRINITY_PLUGIN_DIRS": plugin_dir()}
    explorer = subprocess.Popen(
        [sys.executable, "-c", EXPLORER, path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert said(explorer, "written"), explorer.stderr.read()
        strategy = DefaultSampleStrategy(config.buffer)
        steps = [asyncio.run(strategy.sample(step=s))[0] for s in (1, 2)]
        assert sorted(e.eid.tid for b in steps for e in b) == ["1/0", "1/0", "1/1", "1/1"]
        ended: list[BaseException] = []

        def trainer_step() -> None:
            try:
                asyncio.run(strategy.sample(step=3))
            except BaseException as exc:
                ended.append(exc)

        waiting = threading.Thread(target=trainer_step)
        waiting.start()
        explorer.stdin.write("finish\n")
        explorer.stdin.flush()
        assert said(explorer, "released"), explorer.stderr.read()
        waiting.join(timeout=30)
        assert not waiting.is_alive()
        assert len(ended) == 1 and isinstance(ended[0], StopAsyncIteration)
        with pytest.raises(StopAsyncIteration):  # and so does every read after it
            asyncio.run(strategy.sample(step=3))
        assert explorer.wait(timeout=30) == 0
    finally:
        if explorer.poll() is None:
            explorer.kill()
            explorer.wait()


def test_a_new_writer_opens_the_table_again(server: ExpbufServer, table: Table) -> None:
    table(group_size=2, estimator="grpo")
    config = buffer_config(server, 2)
    write(config, single_turn(0, [1.0, 2.0]))
    reader = trinity.buffer.get_buffer_reader(config)
    assert len(asyncio.run(reader.read())) == 2
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())
    write(config, single_turn(1, [1.0, 2.0]))  # a second run of the explorer
    assert [e.eid.tid for e in asyncio.run(reader.read())] == ["5/1", "5/1"]


# ---- exact batch sizes -------------------------------------------------------------------------------


def test_batches_are_exact_and_never_larger(server: ExpbufServer, table: Table) -> None:
    table(group_size=2, estimator="grpo")
    write(buffer_config(server, 4), *[single_turn(t, [1.0, 2.0]) for t in range(4)], release=False)
    with pytest.raises(ValueError, match=r"batch_size 3 is not a multiple of the group_size 2.*multiple of 2"):
        trinity.buffer.get_buffer_reader(buffer_config(server, 3))
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 4))
    assert len(asyncio.run(reader.read())) == 4
    assert len(asyncio.run(reader.read(batch_size=2))) == 2
    with pytest.raises(ValueError, match="batch_size 3 is not a multiple"):
        asyncio.run(reader.read(batch_size=3))


def test_groups_of_varying_size_fill_a_batch_as_far_as_whole_groups_go(server: ExpbufServer, table: Table) -> None:
    table(group_size=0, estimator="grpo")
    sizes = [3, 2, 4, 1, 6]
    write(buffer_config(server, 5), *[single_turn(t, [float(r) for r in range(n)]) for t, n in enumerate(sizes)])
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 5))
    assert [len(asyncio.run(reader.read())) for _ in range(2)] == [5, 5]  # 3 + 2, then 4 + 1
    with pytest.raises(ValueError, match="group 5/4 has 6 experiences, more than batch_size 5"):
        asyncio.run(reader.read())
    assert len(asyncio.run(reader.read(batch_size=6))) == 6  # the group went back, first in line
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def test_a_take_of_several_groups_that_does_not_fit_goes_back_whole(server: ExpbufServer, table: Table) -> None:
    """After a group of 2, the reader asks for 2 more groups (4 experiences would fit): they are
    2 + 4, too many, so both go back and it goes on one group at a time, in order."""
    table(group_size=0, estimator="grpo")
    sizes = [2, 2, 4, 2]
    write(buffer_config(server, 6), *[single_turn(t, [float(r) for r in range(n)]) for t, n in enumerate(sizes)])
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 6))
    reads = [asyncio.run(reader.read()) for _ in range(2)]
    assert [sorted({e.eid.tid for e in r}) for r in reads] == [["5/0", "5/1"], ["5/2", "5/3"]]
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.leased, stats.ready) == (6, 0)  # the second read's groups, acknowledged on the next


# ---- Trinity's buffer settings ---------------------------------------------------------------------


def test_capacity_is_the_tables_and_blocks_the_writer(server: ExpbufServer, table: Table) -> None:
    """Trinity's queue_test: at capacity 4 the 5th write blocks until a read makes room."""
    table(group_by="none", estimator="none")
    with pytest.raises(ValueError, match=r"capacity=4.*create it with capacity_experiences = 4"):
        trinity.buffer.get_buffer_writer(buffer_config(server, 1, capacity=4))
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.drop_table(TABLE)
    table(group_by="none", estimator="none", capacity_experiences=4, when_full="block")
    config = buffer_config(server, 1, "delivery=consume", capacity=4)
    writer = trinity.buffer.get_buffer_writer(config)
    for i in range(4):
        asyncio.run(writer.write(single_turn(i, [1.0])))
    fifth = threading.Thread(target=lambda: asyncio.run(writer.write(single_turn(4, [1.0]))))
    fifth.start()
    fifth.join(timeout=2)
    assert fifth.is_alive(), "the 5th write did not block"
    reader = trinity.buffer.get_buffer_reader(config)
    assert [e.eid.tid for e in asyncio.run(reader.read())] == ["5/0"]
    fifth.join(timeout=30)
    assert not fifth.is_alive()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.stats(TABLE)[TABLE].pushed == 5


def test_a_read_of_groups_of_varying_size_that_fill_the_table_returns_them(server: ExpbufServer, table: Table) -> None:
    """A table of groups of varying size (group_size 0) and capacity 8 that blocks, and a read of 8:
    the read held two groups of 3 and waited for one more, which the explorer could not push beside
    them (its write blocked): both waited to the read's max_read_timeout, the read gave the groups
    back and took them again, and so on for good (a helper's audit). A read whose groups leave no
    room for another returns them, and the explorer's write goes on."""
    table(group_size=0, estimator="grpo", capacity_experiences=8, when_full="block")
    config = buffer_config(server, 8, "delivery=consume", capacity=8, max_read_timeout=20.0)
    writer = trinity.buffer.get_buffer_writer(config)
    for task in range(2):
        asyncio.run(writer.write(single_turn(task, [1.0, 2.0, 3.0])))
    third = threading.Thread(target=lambda: asyncio.run(writer.write(single_turn(2, [1.0, 2.0, 3.0]))))
    third.start()
    reader = trinity.buffer.get_buffer_reader(config)
    assert sorted({e.eid.tid for e in asyncio.run(reader.read())}) == ["5/0", "5/1"]
    third.join(timeout=30)
    assert not third.is_alive(), "the explorer's write stayed blocked"
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.consumed, stats.ready, stats.leased) == (6, 3, 0), stats


def test_a_batch_larger_than_the_tables_capacity_is_refused(server: ExpbufServer, table: Table) -> None:
    """A read waits for a whole batch, which a table that holds fewer experiences never has."""
    table(group_size=2, estimator="none", capacity_experiences=4, when_full="block")
    with pytest.raises(ValueError, match=r"batch_size 6 is more than the 4 experiences expbuf table 'jobs' holds"):
        trinity.buffer.get_buffer_reader(buffer_config(server, 6))
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 4))
    with pytest.raises(ValueError, match=r"batch_size 8 is more than the 4 experiences .*capacity_experiences"):
        asyncio.run(reader.read(batch_size=8))


def test_trinitys_priority_queue_newest_version_first_at_capacity(server: ExpbufServer, table: Table) -> None:
    """Trinity's replay_buffer (linear_decay, no reuse): 12 writes at capacity 8 are read
    highest model_version first, 11 down to 4, each with use_count 1, as from its AsyncPriorityQueue."""
    table(group_by="none", estimator="none", capacity_experiences=8, when_full="evict")
    replay = ReplayBufferConfig(enable=True, priority_fn="linear_decay", priority_fn_args={"decay": 2.0})
    config = buffer_config(server, 8, capacity=8, replay_buffer=replay)
    write(config, *[single_turn(v, [1.0], version=v) for v in range(12)])
    reader = trinity.buffer.get_buffer_reader(config)
    got = asyncio.run(reader.read())
    assert [e.info["model_version"] for e in got] == list(range(11, 3, -1))
    assert {e.info["use_count"] for e in got} == {1}
    with pytest.raises(StopAsyncIteration):  # read once each: no reuse
        asyncio.run(reader.read())


def test_a_write_into_an_evicting_table_full_of_leased_groups_waits_without_hammering_the_server(
    server: ExpbufServer, table: Table
) -> None:
    """An evicting table whose every group is leased refuses a push at once (nothing to evict):
    the write waits for the trainer's ack, pausing between its tries rather than sending its
    payload again in a tight loop, and is stored once the ack makes room."""
    table(group_by="none", estimator="none", capacity_experiences=4, when_full="evict")
    replay = ReplayBufferConfig(enable=True, priority_fn="linear_decay", priority_fn_args={"decay": 2.0})
    config = buffer_config(server, 4, capacity=4, replay_buffer=replay)
    # The writer stays open, as a job's rollout workers do: a reader that finds the table empty
    # once its writers are done ends, where this one waits for the fifth write.
    write(config, *[single_turn(v, [1.0], version=v) for v in range(4)], release=False)
    reader = trinity.buffer.get_buffer_reader(config)
    assert len(asyncio.run(reader.read())) == 4  # leased until the next read
    writer = trinity.buffer.get_buffer_writer(config)
    fifth = threading.Thread(target=lambda: asyncio.run(writer.write(single_turn(9, [1.0], version=9))))
    fifth.start()
    fifth.join(timeout=2)
    assert fifth.is_alive(), "the write did not wait for room"
    refused = sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count"
        and dict(labels) == {"method": "Push", "code": "RESOURCE_EXHAUSTED"}
    )
    assert 1 <= refused <= 40, f"{refused:.0f} pushes refused in 2 s: the writer retries a full table in a tight loop"
    assert [e.info["model_version"] for e in asyncio.run(reader.read(batch_size=1))] == [9]  # the ack made room
    fifth.join(timeout=30)
    assert not fifth.is_alive()


def test_what_a_table_cannot_run_of_trinitys_priority_queue_is_refused_by_name(
    server: ExpbufServer, table: Table
) -> None:
    table(group_by="none", estimator="none")
    refused = {
        r"priority_fn_args.sigma=0.5 without reuse": ReplayBufferConfig(
            enable=True, priority_fn="decay_limit_randomization", priority_fn_args={"sigma": 0.5}
        ),
        "runs linear_decay and decay_limit_randomization": ReplayBufferConfig(enable=True, priority_fn="mine"),
    }
    for message, replay in refused.items():
        for factory in (trinity.buffer.get_buffer_writer, trinity.buffer.get_buffer_reader):
            with pytest.raises(ValueError, match=rf"replay_buffer \(priority_fn=.*{message}"):
                factory(buffer_config(server, 2, replay_buffer=replay))
    with pytest.raises(ValueError, match=r"capacity=8.*when_full = 'evict'"):
        trinity.buffer.get_buffer_writer(buffer_config(server, 2, capacity=8, replay_buffer=ReplayBufferConfig(True)))
    with pytest.raises(ValueError, match="leave the path's order and delivery options out"):
        trinity.buffer.get_buffer_reader(buffer_config(server, 2, "order=lifo", replay_buffer=ReplayBufferConfig(True)))


def test_an_sql_buffers_replay_buffer_is_refused_by_name(server: ExpbufServer, table: Table) -> None:
    """Trinity's SQL experience buffer with replay_buffer.enable reads its rows again without
    bound, the least read first (its SQLExperienceStorage._read_priority), where its queue reads
    each once by priority; an expbuf path ran the queue's, read once, so a job moved from SQL
    lost its re-reads silently. Refused by name, for the writer and the reader, saying what to
    set; an SQL buffer without replay_buffer is taken as before."""
    table(group_by="none", estimator="none")
    replay = ReplayBufferConfig(enable=True, priority_fn="linear_decay", priority_fn_args={"decay": 2.0})
    config = buffer_config(server, 2, storage_type="sql", replay_buffer=replay)
    for factory in (trinity.buffer.get_buffer_writer, trinity.buffer.get_buffer_reader):
        with pytest.raises(ValueError, match=r"storage_type 'sql' with replay_buffer.enable.*storage_type: queue"):
            factory(config)
    plain = buffer_config(server, 2, storage_type="sql", replay_buffer=ReplayBufferConfig(enable=False))
    write(plain, single_turn(0, [1.0]), single_turn(1, [2.0]))
    assert len(asyncio.run(trinity.buffer.get_buffer_reader(plain).read())) == 2


def test_a_release_without_an_acquire_ends_the_table_as_trinitys_buffers_end(
    server: ExpbufServer, table: Table
) -> None:
    """Trinity's storages count their writers down at each release and end their readers at zero
    or below (QueueStorage, SQLExperienceStorage, FileStorage): a writer released without an
    acquire ends them. Through the plug-in the table's reads end too, after what is ready."""
    storage = QueueStorage(ExperienceBufferConfig(name="q", path="memory", batch_size=1).to_storage_config())

    async def on_trinity() -> None:
        await storage.put_batch(Experience.serialize_many(single_turn(0, [1.0])))
        assert await storage.release() == -1
        await storage.get_batch(1, timeout=5.0)
        with pytest.raises(StopAsyncIteration):
            await storage.get_batch(1, timeout=5.0)

    asyncio.run(on_trinity())
    table(group_by="none", estimator="none")
    config = buffer_config(server, 1)

    async def on_expbuf() -> None:
        writer = trinity.buffer.get_buffer_writer(config)
        reader = trinity.buffer.get_buffer_reader(config)
        await writer.write(single_turn(0, [1.0]))
        assert await writer.release() == 0
        assert len(await reader.read()) == 1
        with pytest.raises(StopAsyncIteration):  # ended (a TimeoutError after max_read_timeout before)
            await reader.read()

    asyncio.run(on_expbuf())


def test_a_writer_used_again_after_its_last_release_writes_on(server: ExpbufServer, table: Table) -> None:
    """A writer's last release closed its connection, and its next acquire, write or release failed
    with gRPC's bare ValueError of a closed channel, naming neither the writer nor the table (a
    helper's audit). The writer connects again: an explorer that acquires it for its next stage
    writes on. A reader read after its close() is refused naming it, not with that ValueError."""
    table(group_by="none", estimator="none")
    config = buffer_config(server, 1)
    writer = trinity.buffer.get_buffer_writer(config)

    async def twice() -> list[int]:
        counts = [await writer.acquire()]
        await writer.write(single_turn(0, [1.0]))
        counts.append(await writer.release())
        counts.append(await writer.acquire())
        await writer.write(single_turn(1, [2.0]))
        counts.append(await writer.release())
        return counts

    assert asyncio.run(twice()) == [1, 0, 1, 0]
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.stats(TABLE)[TABLE].pushed == 2
    reader = trinity.buffer.get_buffer_reader(config)
    assert len(asyncio.run(reader.read())) == 1
    reader.close()
    with pytest.raises(RuntimeError, match=r"expbuf reader of table 'jobs' was closed"):  # not a bare ValueError
        asyncio.run(reader.read())


def test_replay_reads_everything_again_up_to_max_times_sampled(server: ExpbufServer, table: Table) -> None:
    """Trinity's sql_test with replay ("we can read all again"), bounded by the table's max_times_sampled."""
    table(group_by="none", estimator="none", max_times_sampled=2)
    pushed = [exp for t in range(6) for exp in single_turn(t, [float(t)], version=t)]
    write(buffer_config(server, 6), pushed)
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 6, "delivery=replay&order=lifo"))
    for _ in range(2):
        assert [e.info["model_version"] for e in asyncio.run(reader.read())] == [5, 4, 3, 2, 1, 0]
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def test_consume_delivery_and_groups_of_varying_size(server: ExpbufServer, table: Table) -> None:
    table(group_size=0, estimator="grpo")
    write(buffer_config(server, 4), single_turn(0, [1.0, 2.0, 3.0]), single_turn(1, [1.0, 2.0]), release=False)
    reader = trinity.buffer.get_buffer_reader(buffer_config(server, 4, "delivery=consume"))
    assert len(asyncio.run(reader.read())) == 3
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.consumed, stats.leased, stats.ready) == (3, 0, 2)
    with pytest.raises(ValueError, match="delivery=replay: table 'jobs' has groups of varying size"):
        trinity.buffer.get_buffer_reader(buffer_config(server, 4, "delivery=replay"))


def test_a_taskset_on_expbuf_names_its_dataset(server: ExpbufServer, table: Table) -> None:
    """A taskset on expbuf is a dataset of prompts (tests/test_trinity_taskset.py); a path that names
    none is refused, saying what to name."""
    table(group_size=2)
    taskset = TasksetConfig(name="tasks", path=f"expbuf://127.0.0.1:{server.port}/{TABLE}", batch_size=4)
    with pytest.raises(ValueError, match=r"reads a dataset of prompts; name it and its rows in the path"):
        trinity.buffer.get_buffer_reader(taskset)


# ---- Trinity's queue_test and sql_test scenarios -------------------------------------------------------


def test_queue_test_scenario_without_eids(server: ExpbufServer, table: Table, caplog: pytest.LogCaptureFixture) -> None:
    """Trinity's test_queue_buffer: experiences without eids, float tokens, writes of 2 and reads
    of 4, a read of another size, then StopAsyncIteration once the writer releases."""
    table(group_by="task", group_size=0, estimator="none")
    config = buffer_config(server, 4, max_read_timeout=3.0)

    def exps(n: int, mask: bool = False) -> list[Experience]:
        return [
            Experience(
                tokens=torch.tensor([float(j) for j in range(i + 1)]),
                prompt_length=i,
                reward=float(i),
                logprobs=torch.tensor([0.1]),
                **({"action_mask": torch.tensor([1])} if mask else {}),  # the response's length (1 token)
            )
            for i in range(1, n + 1)
        ]

    async def scenario() -> None:
        writer = trinity.buffer.get_buffer_writer(config)
        reader = trinity.buffer.get_buffer_reader(config)
        assert await writer.acquire() == 1
        written = []
        for _ in range(4):
            batch = exps(2)
            written += batch
            await writer.write(batch)
        read = [await reader.read() for _ in range(2)]
        assert [len(r) for r in read] == [4, 4]
        # Each experience without an eid is a group of its own: a new task, set on its eid as written.
        sent = {exp.eid.tid: exp for exp in written}
        assert len(sent) == 8 and all(re.fullmatch(r"/[0-9a-f]{24}", tid) for tid in sent)
        assert sorted(e.eid.tid for e in read[0] + read[1]) == sorted(sent)
        for got in read[0] + read[1]:
            assert got.tokens.dtype == torch.float32 and torch.equal(got.tokens, sent[got.eid.tid].tokens)
        with caplog.at_level(logging.WARNING, logger="expbuf.client.trinity.buffer"):
            await writer.write(written[:2])  # a retried write: stored once, and the writer says so
        assert f"2 of 2 experiences written to table 'jobs' were stored already (first: {written[0].eid.uid})" in (
            caplog.text
        )
        await writer.write(exps(4, mask=True))
        assert len(await reader.read(batch_size=4)) == 4
        assert await writer.release() == 0
        with pytest.raises(StopAsyncIteration):
            await reader.read()
        with pytest.raises(StopAsyncIteration):
            await reader.read(batch_size=1)

    asyncio.run(scenario())


def test_experiences_without_eids_whose_suffixes_agree_are_each_stored(server: ExpbufServer, table: Table) -> None:
    """Trinity-RFT's EID draws 6 random hex digits as a suffix, which two of some thousands share: two
    experiences without an eid that share one are each a group of their own, both stored (the second
    was refused as a conflict with the first), and the same objects written again are stored once."""
    table(group_by="task", group_size=0, estimator="none")
    config = buffer_config(server, 2, max_read_timeout=3.0)
    exps = [
        Experience(
            tokens=torch.tensor([1.0, 2.0, float(i)]), prompt_length=1, reward=float(i), eid=EID(suffix="abcdef")
        )
        for i in range(2)
    ]

    async def scenario() -> None:
        writer = trinity.buffer.get_buffer_writer(config)
        reader = trinity.buffer.get_buffer_reader(config)
        assert await writer.acquire() == 1
        await writer.write(exps)
        await writer.write(exps)  # a retried write of the same objects
        read = await reader.read()
        assert sorted(float(got.tokens[2]) for got in read) == [0.0, 1.0]
        assert {got.eid.uid for got in read} == {exp.eid.uid for exp in exps} and exps[0].eid.uid != exps[1].eid.uid
        assert await writer.release() == 0

    asyncio.run(scenario())
    assert BufferClient(f"127.0.0.1:{server.port}").stats(TABLE)[TABLE].pushed == 2


def test_sql_test_scenario_reads_the_newer_experiences(server: ExpbufServer, table: Table) -> None:
    """Trinity's test_sql_exp_buffer_read_write without replay: 8 written, read 2 x 4, 4 newer
    written and read; reads past the end wait for max_read_timeout while the writer is open."""
    table(group_by="none", estimator="none")
    config = buffer_config(server, 4, max_read_timeout=0.5)

    async def scenario() -> None:
        writer = trinity.buffer.get_buffer_writer(config)
        reader = trinity.buffer.get_buffer_reader(config)
        assert await writer.acquire() == 1
        for _ in range(4):
            await writer.write(
                [
                    Experience(tokens=torch.tensor([1.0, 2.0]), prompt_length=1, reward=1.0,
                               logprobs=torch.tensor([0.1]), info={"model_version": i})
                    for i in (1, 2)
                ]
            )  # fmt: skip
        assert [len(await reader.read()) for _ in range(2)] == [4, 4]
        newer = [Experience(tokens=torch.tensor([float(j) for j in range(i + 1)]), prompt_length=i, reward=float(i),
                            logprobs=torch.tensor([0.1]), action_mask=torch.tensor([1]),
                            info={"model_version": i + 2}) for i in range(1, 5)]  # fmt: skip
        await writer.write(newer)
        got = await reader.read(batch_size=4)
        assert len(got) == 4 and all(exp.info["model_version"] > 2 for exp in got)
        with pytest.raises(TimeoutError, match="max_read_timeout"):
            await reader.read()
        assert await writer.release() == 0
        with pytest.raises(StopAsyncIteration):
            await reader.read()

    asyncio.run(scenario())


def test_the_writers_count_refuses_what_it_cannot_count(server: ExpbufServer, table: Table) -> None:
    """The Writers RPC: a table that does not exist, a change other than +1/-1/0, and a dropped
    table's count, which goes with it."""
    import grpc

    from expbuf.client import BufferError

    table(group_size=2)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(BufferError) as missing:
            client.writers("nosuch", 1)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(BufferError, match=r"change is 2; expected \+1") as bad:
            client.writers(TABLE, 2)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.writers(TABLE) == (0, False)  # never opened: not done
        assert client.writers(TABLE, 1) == (1, False)
        assert client.writers(TABLE, -1) == (0, True)
        assert client.writers(TABLE, -1) == (0, True)  # a close too many changes nothing
        client.drop_table(TABLE)
        client.create_table(TABLE, group_size=2)
        assert client.writers(TABLE) == (0, False)


# ---- Trinity's priority queue with reuse -----------------------------------------------------------
# The same writes and reads through Trinity's buffer factories on an expbuf:// table and through
# Trinity's own priority queue (its QueueStorage with AsyncPriorityQueue, in this process as its Ray
# actor runs it) give the same experiences in the same order, re-reads and use counts included.

RUNS = 2  # experiences per write: one task's runs, one item of Trinity's queue, one group of the table
Seen = tuple[int, int, int, int]  # task, run, model_version, use_count
Script = list[tuple[str, int]]  # ("write", version) writes the next task; ("read", n) reads n times


def task(number: int, version: int) -> list[Experience]:
    """One task's runs as Trinity's workflow runner writes them (use_count 0)."""
    return [
        Experience(
            eid=EID(batch=7, task=number, run=run),
            tokens=torch.arange(6, dtype=torch.int32),
            prompt_length=2,
            logprobs=torch.full((4,), -0.5),
            reward=float(run),
            info={"model_version": version, "use_count": 0},
        )
        for run in range(RUNS)
    ]


def seen(exps: list[Experience]) -> list[Seen]:
    return [(int(e.eid.task), e.eid.run, e.info["model_version"], e.info["use_count"]) for e in exps]


async def play(
    write: Callable[[list[Experience]], Awaitable[object]],
    read: Callable[[], Awaitable[list[Experience]]],
    release: Callable[[], Awaitable[object]],
    script: Script,
) -> list[list[Seen]]:
    """The script with the writer open, then the writer released and every read until the end of data."""
    reads, tasks = [], 0
    for op, arg in script:
        if op == "write":
            await write(task(tasks, arg))
            tasks += 1
        else:
            reads += [seen(await read()) for _ in range(arg)]
    await release()
    while True:
        try:
            reads.append(seen(await read()))
        except StopAsyncIteration:
            return reads


def on_trinity(replay: ReplayBufferConfig, script: Script) -> list[list[Seen]]:
    """The script on Trinity's own priority queue."""
    config = ExperienceBufferConfig(
        name="trinity", path="memory", storage_type="queue", batch_size=RUNS, replay_buffer=replay
    ).to_storage_config()

    async def run() -> list[list[Seen]]:
        storage = QueueStorage(config)
        await storage.acquire()

        async def read() -> list[Experience]:
            exps = Experience.deserialize_many(await storage.get_batch(RUNS, timeout=5.0))
            await asyncio.sleep(0)  # a cooldown of 0 puts the item back before anything else happens
            return exps

        return await play(
            lambda data: storage.put_batch(Experience.serialize_many(data)), read, storage.release, script
        )

    return asyncio.run(run())


def on_expbuf(server: ExpbufServer, replay: ReplayBufferConfig, script: Script) -> list[list[Seen]]:
    """The script through Trinity's buffer factories on an expbuf:// path."""
    config = buffer_config(server, RUNS, replay_buffer=replay)

    async def run() -> list[list[Seen]]:
        writer = trinity.buffer.get_buffer_writer(config)
        reader = trinity.buffer.get_buffer_reader(config)
        await writer.acquire()
        return await play(writer.write, reader.read, writer.release, script)

    return asyncio.run(run())


# Trinity's ReplayBufferConfig of a reuse test, as its keywords: the parameters are collected before
# Trinity is imported (import_frameworks).
LINEAR = {"enable": True, "reuse_cooldown_time": 0.0, "priority_fn_args": {"decay": 2.0}}
LIMITED = {
    "enable": True,
    "priority_fn": "decay_limit_randomization",
    "reuse_cooldown_time": 0.0,
    "priority_fn_args": {"decay": 1.0, "use_count_limit": 2, "sigma": 0.0},
}


def reuse_table(table: Table, **settings: object) -> None:
    table(group_by="task", group_size=RUNS, estimator="none", **settings)


@pytest.mark.parametrize(
    ("replay", "settings", "script"),
    [
        pytest.param(
            LINEAR,
            {"priority_decay": 2.0},
            [
                ("write", 2),
                ("write", 5),
                ("write", 3),
                ("read", 2),
                ("write", 5),
                ("read", 3),
                ("write", 0),
                ("read", 6),
            ],
            id="linear_decay",
        ),
        pytest.param(
            LIMITED,
            {"priority_decay": 1.0, "max_times_sampled": 2},
            [("write", 1), ("write", 4), ("write", 2), ("read", 3), ("write", 4), ("read", 3)],
            id="decay_limit",
        ),
    ],
)
def test_reuse_reads_as_trinitys_priority_queue(
    server: ExpbufServer, table: Table, replay: dict, settings: dict, script: Script
) -> None:
    """Each read takes the highest priority, model_version - decay * use_count (ties: the earliest
    put, a returning item behind), and puts it back; after the writer releases, what is left is read
    once more; with a use_count_limit an item goes for good at its limit."""
    reuse_table(table, **settings)
    config = ReplayBufferConfig(**replay)
    want = on_trinity(config, script)
    assert len(want) > sum(n for op, n in script if op == "read")  # re-reads, and reads after the release
    assert max(use for read in want for *_, use in read) > 1
    assert on_expbuf(server, config, script) == want


def test_a_returning_experience_waits_for_its_cooldown(server: ExpbufServer, table: Table) -> None:
    """With reuse_cooldown_time 2 s, the newest task read first is not read again before the older
    one, however high its lowered priority; a read then waits for the cooldown, as Trinity's does."""
    replay = ReplayBufferConfig(enable=True, reuse_cooldown_time=2.0, priority_fn_args={"decay": 2.0})
    reuse_table(table, priority_decay=2.0, reuse_cooldown_seconds=2.0)
    script: Script = [("write", 10), ("write", 1), ("read", 4)]
    want = on_trinity(replay, script)
    assert [(read[0][0], read[0][3]) for read in want] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert on_expbuf(server, replay, script) == want


def test_randomised_priorities_keep_trinitys_invariants(server: ExpbufServer, table: Table) -> None:
    """decay_limit_randomization with sigma: the order is random, but every task is read exactly
    use_count_limit times, its use counts going 1, 2, 3, its runs together; nothing after that."""
    replay = ReplayBufferConfig(
        enable=True,
        priority_fn="decay_limit_randomization",
        reuse_cooldown_time=0.0,
        priority_fn_args={"decay": 1.0, "use_count_limit": 3, "sigma": 1.0},
    )
    reuse_table(table, priority_decay=1.0, max_times_sampled=3, priority_noise=1.0)
    script: Script = [*[("write", version) for version in range(4)], ("read", 12)]
    for reads in (on_trinity(replay, script), on_expbuf(server, replay, script)):
        assert len(reads) == 12
        uses: dict[int, list[int]] = defaultdict(list)
        for read in reads:
            assert len({(t, use) for t, _, _, use in read}) == 1 and [run for _, run, _, _ in read] == [0, 1]
            uses[read[0][0]].append(read[0][3])
        assert uses == {number: [1, 2, 3] for number in range(4)}
        assert Counter(v for read in reads for _, _, v, _ in read) == {v: RUNS * 3 for v in range(4)}
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.consumed, stats.ready, stats.leased) == (4 * RUNS, 0, 0)


def test_what_reuse_cannot_run_is_refused_by_name(server: ExpbufServer, table: Table) -> None:
    reuse_table(table, priority_decay=2.0)
    cooled = ReplayBufferConfig(enable=True, reuse_cooldown_time=1.0, priority_fn_args={"decay": 2.0})
    need = "priority_decay = 2.0, reuse_cooldown_seconds = 1.0, max_times_sampled = 0, priority_noise = 0.0"
    with pytest.raises(ValueError, match=rf"has reuse_cooldown_seconds=0.0; create it with {need}"):
        trinity.buffer.get_buffer_reader(buffer_config(server, RUNS, replay_buffer=cooled))
    with pytest.raises(ValueError, match=r"capacity=8 with replay_buffer reuse_cooldown_time=0.0"):
        trinity.buffer.get_buffer_writer(
            buffer_config(server, RUNS, capacity=8, replay_buffer=ReplayBufferConfig(**LINEAR))
        )
    with pytest.raises(ValueError, match="leave the path's order and delivery options out"):
        trinity.buffer.get_buffer_reader(
            buffer_config(server, RUNS, "delivery=consume", replay_buffer=ReplayBufferConfig(**LINEAR))
        )
    still = ReplayBufferConfig(enable=True, reuse_cooldown_time=0.0, priority_fn_args={"decay": 0.0})
    with pytest.raises(ValueError, match=r"reuse_cooldown_time=0.0 with decay 0.0: .* set one of them"):
        trinity.buffer.get_buffer_reader(buffer_config(server, RUNS, replay_buffer=still))
    unknown = ReplayBufferConfig(enable=True, priority_fn_args={"decay": 1.0, "use_count_limit": 2})
    with pytest.raises(ValueError, match="unknown priority_fn_args use_count_limit; it takes decay"):
        trinity.buffer.get_buffer_writer(buffer_config(server, RUNS, replay_buffer=unknown))
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.drop_table(TABLE)
    table(group_size=0, estimator="none", priority_decay=2.0)
    with pytest.raises(ValueError, match="replay_buffer reuse_cooldown_time: table 'jobs' has groups of varying size"):
        trinity.buffer.get_buffer_reader(buffer_config(server, RUNS, replay_buffer=ReplayBufferConfig(**LINEAR)))


# ---- the docs' jobs ---------------------------------------------------------------------------------
# The docs' Trinity page shows each job as a table (TOML) and the part of a Trinity config that
# uses it (YAML). These tests read those blocks from the page, so the two cannot drift, load each job
# with Trinity's load_config and check_and_update(), create its table and run it through the plug-in.

README_ADDRESS = "10.0.0.5:50051"


def readme_blocks(language: str) -> list[str]:
    """The code blocks in `language` of the docs' Trinity page, in order."""
    return code_blocks(page("frameworks/trinity.md"), language)


def readme_tables() -> dict[str, dict]:
    return {table["name"]: table for block in readme_blocks("toml") for table in tomllib.loads(block)["tables"]}


def readme_jobs() -> dict[str, str]:
    """Each job's YAML by the table its path names."""
    jobs = [block for block in readme_blocks("yaml") if "train_batch_size" in block]
    return {re.search(rf"expbuf://{re.escape(README_ADDRESS)}/(\w+)", job).group(1): job for job in jobs}


def cpu_cluster() -> dict:
    """The page's `cluster` block for a CPU machine, which Trinity's check needs there."""
    return next(yaml.safe_load(block) for block in readme_blocks("yaml") if block.startswith("cluster:"))


def test_the_cpu_recipe_declares_the_gpus_trinity_counts() -> None:
    """Without gpu_per_node, check_and_update() asks Ray for the cluster's GPUs and divides by them."""
    cluster = cpu_cluster()["cluster"]
    assert cluster["gpu_per_node"] > 0 and cluster["node_num"] == 1, cluster


def readme_job(server: ExpbufServer, tmp_path: Path, name: str) -> Config:
    """The README's job on the table `name`, with the rest of a job on this machine, loaded and
    checked by Trinity; its table created as the README says."""
    rest = {
        "project": "expbuf",
        "name": name,
        "mode": "both",
        "checkpoint_root_dir": str(tmp_path / "checkpoints"),
        "model": {"model_path": str(tmp_path), "max_model_len": 4096},
        **cpu_cluster(),  # the page's recipe: Ray counts no GPUs on a CPU machine
        "buffer": {"batch_size": 32, "total_epochs": 1, "explorer_input": {"taskset": {"name": "tasks"}}},
    }
    job = yaml.safe_load(readme_jobs()[name].replace(README_ADDRESS, f"127.0.0.1:{server.port}"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.merge(rest, job))))
    config = load_config(str(path))
    config.buffer.explorer_input.taskset.path = str(tmp_path)
    config.check_and_update()
    settings = dict(readme_tables()[name])
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(settings.pop("name"), **settings)
    return config


def eight_runs(task: int) -> list[Experience]:
    """A task's 8 runs, generated by policy version `task`."""
    return single_turn(task, [float(run) for run in range(8)], version=task)


def test_the_readme_shows_four_jobs_and_their_tables() -> None:
    assert sorted(readme_jobs()) == ["agent", "grpo8", "replay8", "reuse8"]
    assert set(readme_jobs()) <= set(readme_tables())


def test_readme_multi_step_job(server: ExpbufServer, tmp_path: Path) -> None:
    config = readme_job(server, tmp_path, "agent")
    storage = config.buffer.trainer_input.experience_buffer
    assert (config.algorithm.algorithm_type, storage.batch_size) == ("multi_step_grpo", 64)
    pushed = multi_step(0, [1.0, 0.0, 2.0, 0.5], [3, 1, 2, 3]) + multi_step(1, [0.0, 1.0, 3.0, 1.0], [1, 2, 3, 2])
    write(storage, pushed)
    want, _ = StepWiseGRPOAdvantageFn().process(copy.deepcopy(pushed))
    reader = trinity.buffer.get_buffer_reader(storage)
    assert_advantages(asyncio.run(reader.read()), want)  # the writer released: the last, short batch
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def test_readme_filtered_job(server: ExpbufServer, tmp_path: Path) -> None:
    config = readme_job(server, tmp_path, "grpo8")
    config.data_processor.experience_pipeline.save_input = False
    pushed = single_turn(0, [1.0, 0.0, 2.0, 0.25, 1.0, 3.0, 0.0, 2.0]) + eight_runs(1)
    metrics = asyncio.run(run_pipeline(config, pushed))
    assert metrics[0]["experience_pipeline/filtered_count"] == 4.0
    kept = [e for e in pushed if e.reward >= 0.5]
    want, _ = GRPOGroupedAdvantage().process(copy.deepcopy(kept))
    reader = trinity.buffer.get_buffer_reader(config.buffer.trainer_input.experience_buffer)
    assert_advantages(asyncio.run(reader.read()), want)
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def test_readme_replay_job(server: ExpbufServer, tmp_path: Path) -> None:
    storage = readme_job(server, tmp_path, "replay8").buffer.trainer_input.experience_buffer
    write(storage, *[eight_runs(task) for task in range(32)])
    reader = trinity.buffer.get_buffer_reader(storage)
    newest_first = [task for task in range(31, -1, -1) for _ in range(8)]
    for _ in range(3):  # the table's max_times_sampled
        assert [int(e.eid.task) for e in asyncio.run(reader.read())] == newest_first
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def test_readme_replay_job_with_reuse(server: ExpbufServer, tmp_path: Path) -> None:
    """The newest 32 groups first; the next read takes the other 32, since the first cool for 30 s
    whatever their lowered priority; once the explorer releases, nothing ready is left: the end."""
    storage = readme_job(server, tmp_path, "reuse8").buffer.trainer_input.experience_buffer
    assert storage.replay_buffer.reuse_cooldown_time == 30.0
    write(
        storage, *[single_turn(task, [float(r) for r in range(8)], version=task) for task in range(64)], release=False
    )
    reader = trinity.buffer.get_buffer_reader(storage)
    for tasks in (range(63, 31, -1), range(31, -1, -1)):
        got = asyncio.run(reader.read())
        assert [(e.info["model_version"], e.info["use_count"]) for e in got] == [
            (t, 1) for t in tasks for _ in range(8)
        ]
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.stats("reuse8")["reuse8"].leased == 512  # cooling
    asyncio.run(trinity.buffer.get_buffer_writer(storage).release())
    with pytest.raises(StopAsyncIteration):
        asyncio.run(reader.read())


def read_while_written_slowly(storage: ExperienceBufferConfig, tasks: int, reads_first: int) -> list[tuple[int, bool]]:
    """An explorer writes `tasks` groups of 8 one at a time, then waits for `reads_first` reads
    before it releases; the trainer reads until the end of data. Each read's size, and whether
    the explorer had begun to release when it returned."""
    read_done, releasing = threading.Semaphore(0), threading.Event()
    failed: list[BaseException] = []

    def explorer() -> None:
        async def run() -> None:
            writer = trinity.buffer.get_buffer_writer(storage)
            await writer.acquire()
            for number in range(tasks):
                await writer.write(eight_runs(number))
                await asyncio.sleep(0.05)  # a rollout step: slower than a read
            for _ in range(reads_first):
                await asyncio.to_thread(read_done.acquire, timeout=60)
            releasing.set()
            await writer.release()

        try:
            asyncio.run(run())
        except BaseException as exc:
            failed.append(exc)
            releasing.set()

    reader = trinity.buffer.get_buffer_reader(storage)
    writing = threading.Thread(target=explorer)
    writing.start()
    reads = []
    try:
        while True:
            try:
                got = asyncio.run(reader.read())
            except StopAsyncIteration:
                break
            reads.append((len(got), releasing.is_set()))
            read_done.release()
    finally:
        writing.join(timeout=60)
    assert not failed and not writing.is_alive()
    return reads


@pytest.mark.parametrize(("name", "tasks", "reads_first"), [("replay8", 40, 3), ("reuse8", 64, 2)])
def test_readme_fixed_size_jobs_read_whole_batches_while_the_explorer_writes(
    server: ExpbufServer, tmp_path: Path, name: str, tasks: int, reads_first: int
) -> None:
    """Every read that returns before the explorer releases holds exactly train_batch_size
    experiences, however slowly the groups arrive; only reads at the end of data are short."""
    storage = readme_job(server, tmp_path, name).buffer.trainer_input.experience_buffer
    storage.max_read_timeout = 60.0  # a read that never fills fails the test, not hangs it
    reads = read_while_written_slowly(storage, tasks, reads_first)
    before_release = [size for size, released in reads if not released]
    assert len(before_release) >= reads_first
    assert before_release == [256] * len(before_release)
