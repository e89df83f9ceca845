"""Trinity-RFT's data selector `expbuf` (issue 45), driven by Trinity's own TasksetScheduler over a
file taskset, against a real server on loopback: each step's tasks are the prompts an expbuf
dataset's claim order hands out, the experience pipeline's feedback trains them and updates their
statistics, and a curriculum survives restarts of the server and the explorer: the tasks after
each kill -9 are the ones a run without kills reads (skipped where trinity-rft is not installed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient

from helpers import ServerProcess, servers
from test_trinity_plugin import plugin  # noqa: F401 - loads the plugin as Trinity does, for this module too
from test_trinity_taskset import source as rows  # the user's file taskset, one row per prompt
from trinity_explorer_child import WORKFLOW


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity, PassRateCalculator, TasksetScheduler, get_taskset_scheduler, Config, DataSelectorConfig
    global TasksetConfig, SELECTOR_METRIC, Experience
    import test_trinity_plugin

    test_trinity_plugin.import_frameworks()
    import test_trinity_taskset

    test_trinity_taskset.import_frameworks()
    import trinity_explorer_child

    trinity_explorer_child.import_frameworks()
    trinity = pytest.importorskip("trinity")
    from trinity.buffer.operators.mappers.pass_rate_calculator import PassRateCalculator
    from trinity.buffer.task_scheduler import TasksetScheduler, get_taskset_scheduler
    from trinity.common.config import Config, DataSelectorConfig, TasksetConfig
    from trinity.common.constants import SELECTOR_METRIC
    from trinity.common.experience import Experience


SIZE, EPOCHS, BATCH = 16, 3, 4


def value(index: int) -> float:
    """A task's feedback (its runs' mean reward): every run passed, none, or half."""
    return {0: 1.0, 1: 0.0}.get(index % 4, 0.5)


def scheduler(
    target: str, source: Path, explorer_state: dict, epochs: int = EPOCHS, query: str = "", **settings: object
) -> TasksetScheduler:
    """Trinity's scheduler of a job whose file taskset names the selector `expbuf` (its path's
    options `query`): medium tasks first (the pools order, the easy and hard pools without a share)."""
    config = Config()
    config.buffer.batch_size, config.buffer.total_epochs = BATCH, epochs
    kwargs = {
        **settings,
        "path": f"expbuf://{target}/grpo{query}",
        "dataset": "math",
        "order": "pools",
        "order_options": {"easy_share": 0.0, "hard_share": 0.0},
        "pass_threshold": 0.25,
    }
    taskset = TasksetConfig(
        name="math", path=str(source), total_epochs=epochs, batch_size=BATCH, enable_progress_bar=False,
        default_workflow_type=WORKFLOW,
        data_selector=DataSelectorConfig(selector_type="expbuf", seed=7, kwargs=kwargs),
    )  # fmt: skip
    taskset.format.prompt_key, taskset.format.response_key = "question", "answer"
    config.buffer.explorer_input.tasksets = [taskset]
    made = get_taskset_scheduler(explorer_state, config)
    assert isinstance(made, TasksetScheduler)  # the scheduler of a taskset with a selector
    return made


def explore(data: str, start: Callable[..., ServerProcess], source: Path, kills: set[int]) -> list[list[int]]:
    """Every step: the scheduler reads its tasks, the pipeline's feedback comes back; after the
    steps in `kills`, the server is SIGKILLed and the explorer restarts from its checkpoint state."""
    server = start(data)
    with BufferClient(server.target) as admin:
        admin.create_table("grpo", group_size=0, estimator="none")
    steps: list[list[int]] = []
    tasks = scheduler(server.target, source, {})
    try:
        for step in range(SIZE * EPOCHS // BATCH):
            read = asyncio.run(tasks.read())
            indices = [task.index["index"] for task in read]
            steps.append(indices)
            tasks.feedback({SELECTOR_METRIC: {0: {"indices": indices, "values": [value(i) for i in indices]}}})
            if step in kills:
                state = {"latest_iteration": step + 1, "taskset_states": tasks.state_dict()}
                server.proc.kill()
                server.proc.wait(30)
                server = start(data)
                tasks = scheduler(server.target, source, state)
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())  # the scheduler's steps are the dataset's epochs
        with BufferClient(server.target) as admin:
            info = admin.ledger("grpo", "math")
            assert info.done and info.total("trained") == SIZE * EPOCHS
            stats = {p.index: p.stats for p in admin.list_prompts("grpo", "math", limit=100).prompts}
    finally:
        server.proc.kill()
        server.proc.wait(30)
    for index, got in stats.items():
        assert got is not None and (got.generated, got.trained, got.runs) == (EPOCHS, EPOCHS, EPOCHS), index
        assert got.last_mean == value(index) and got.passes == EPOCHS * (value(index) > 0.25)
    return steps


def test_trinitys_scheduler_reads_the_orders_tasks_the_same_through_two_kills(tmp_path: Path) -> None:
    source = rows(tmp_path, rows=SIZE)
    with servers() as start:
        calm = explore(str(tmp_path / "calm"), start, source, set())
        killed = explore(str(tmp_path / "killed"), start, source, {3, 7})
    assert killed == calm
    epochs = [[i for step in calm[e * SIZE // BATCH : (e + 1) * SIZE // BATCH] for i in step] for e in range(EPOCHS)]
    assert all(sorted(epoch) == list(range(SIZE)) for epoch in epochs)  # each task once an epoch
    for later in epochs[1:]:  # the medium tasks (half their runs passed) first, by the durable statistics
        assert {value(i) for i in later[: SIZE // 2]} == {0.5}, later


def test_a_selector_without_its_dataset_named_is_refused() -> None:
    config = DataSelectorConfig(selector_type="expbuf", kwargs={"path": "expbuf://127.0.0.1:1/grpo"})
    with pytest.raises(ValueError, match="and dataset None; name the table"):
        trinity.buffer.selector.SELECTORS.get("expbuf")(None, config)
    config.kwargs = {"path": "expbuf://127.0.0.1:1/grpo", "dataset": "math", "orderr": "pools"}
    with pytest.raises(ValueError, match="unknown kwargs orderr"):
        trinity.buffer.selector.SELECTORS.get("expbuf")(None, config)


def report(tasks: TasksetScheduler, indices: list[int], failed: set[int]) -> None:
    """A step's feedback as Trinity's pass_rate_calculator gives it from the step's experiences (two
    runs a task): it merges a step's tasks by index; a task whose runs all failed gives none."""
    runs = [
        Experience(tokens=torch.arange(4), prompt_length=2, reward=value(i) + 0.25 * run,
                   info={"task_index": {"index": i, "taskset_id": 0}})
        for i in indices if i not in failed for run in (0, 1)
    ]  # fmt: skip
    _, metrics = PassRateCalculator().process(runs)
    tasks.feedback(metrics)


@contextlib.contextmanager
def served(tmp_path: Path, source: Path, **settings: object) -> Iterator[tuple[str, TasksetScheduler]]:
    """A server of table `grpo`, and Trinity's scheduler of `source` on it (`scheduler`'s
    settings); the server killed at the end."""
    with servers() as start:
        server = start(str(tmp_path / "data"))
        try:
            with BufferClient(server.target) as admin:
                admin.create_table("grpo", group_size=0, estimator="none")
            yield server.target, scheduler(server.target, source, {}, **settings)
        finally:
            server.proc.kill()
            server.proc.wait(30)


def test_a_step_across_epochs_and_a_task_without_experiences_leave_no_claim_behind(tmp_path: Path) -> None:
    """Trinity's own pass_rate_calculator merges a step's tasks by index (a step that crosses an
    epoch holds an index twice); a task whose runs all failed gives no feedback. Each step's
    feedback trains the prompts it names and releases the one it does not: nothing stays claimed,
    and the released prompt goes out again on top of the next step, so the run's steps train all."""
    with served(tmp_path, rows(tmp_path, rows=6), epochs=2) as (target, tasks):
        read, lost = [], -1
        for step in range(3):  # 12 tasks: 2 epochs of 6 rows, 4 a step
            indices = [task.index["index"] for task in asyncio.run(tasks.read())]
            read.append(indices)
            once = [i for i in indices if indices.count(i) == 1]
            failed = once[0] if step == 1 else None  # every run of one task failed: no experience
            lost = failed if failed is not None else lost
            report(tasks, indices, {failed} if failed is not None else set())
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())  # the scheduler's 3 steps are done
        with BufferClient(target) as admin:
            info = admin.ledger("grpo", "math")
            listed = admin.list_prompts("grpo", "math", limit=100).prompts
    assert info.done and info.total("claimed") == 0 and info.total("trained") == 12
    (again,) = [p for p in listed if p.attempt == 1]  # released: it went out again, first in the next step
    assert again.state == "trained" and again.index == lost and read[2][0] == lost and len(read[2]) == BATCH + 1


def test_a_prompt_released_goes_out_again_before_the_run_ends_or_is_named_at_its_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trinity's scheduler reads rows x epochs / batch_size steps and gives a step's feedback after
    its next read, the last steps' after its last read, as its explorer does. A prompt released by
    a step's feedback goes out again on top of a later step, and every other prompt still goes out
    in the steps left; one released after the last read cannot, and the end names it."""
    with served(tmp_path, rows(tmp_path, rows=12), epochs=1) as (target, tasks):
        read = [[task.index["index"] for task in asyncio.run(tasks.read())] for _ in range(2)]
        report(tasks, read[0], {read[0][0]})  # every run of its first task failed
        read.append([task.index["index"] for task in asyncio.run(tasks.read())])
        report(tasks, read[1], {read[1][0]})
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())  # the scheduler's 3 steps are done
        with caplog.at_level(logging.WARNING, logger="expbuf.client.trinity.selector"):
            report(tasks, read[2], set())  # the last step's feedback: the explorer finishes its steps
        with BufferClient(target) as admin:
            info = admin.ledger("grpo", "math")
    assert read[2][0] == read[0][0] and len(read[2]) == BATCH + 1  # released, out again on top of a step
    assert sorted(i for step in read for i in step) == sorted([*range(12), read[0][0]])  # every prompt went out
    assert (info.total("trained"), info.total("pending"), info.total("claimed")) == (11, 1, 0)
    assert f"prompts not trained in this run: 1 (epoch/index: 0/{read[1][0]})" in caplog.text


def test_prompts_whose_claims_ended_before_their_feedback_go_out_again_within_the_run(tmp_path: Path) -> None:
    """A step's feedback comes after its claims ended (held past hold_seconds, their lease run
    out): the report trains none of them, and they go out again on top of the next step, so the
    run still trains every prompt and leaves none pending or claimed."""
    query = "?lease_seconds=1&hold_seconds=0.2"
    with served(tmp_path, rows(tmp_path, rows=2 * BATCH), epochs=1, query=query) as (target, tasks):
        first = [task.index["index"] for task in asyncio.run(tasks.read())]
        with BufferClient(target) as admin:
            deadline = time.monotonic() + 30
            while admin.ledger("grpo", "math").total("claimed") and time.monotonic() < deadline:
                time.sleep(0.2)  # the keeper lets them go after hold_seconds; their lease then runs out
            assert not admin.ledger("grpo", "math").total("claimed")
        report(tasks, first, set())
        second = [task.index["index"] for task in asyncio.run(tasks.read())]
        report(tasks, second, set())
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())
        with BufferClient(target) as admin:
            info = admin.ledger("grpo", "math")
    assert sorted(second) == list(range(2 * BATCH))  # the ended four on top of the step's own four
    assert info.done and (info.total("trained"), info.total("pending"), info.total("claimed")) == (2 * BATCH, 0, 0)


def test_a_step_whose_every_task_failed_releases_its_prompts_as_a_step_with_one_failed_does(tmp_path: Path) -> None:
    """A step none of whose tasks made an experience gets feedback naming no task from Trinity's
    scheduler: the pipeline ran on nothing (its pass_rate_calculator names no taskset), or had no
    payload to run on (no selector metric at all). Its prompts are released, as a step's tasks it
    does not name are, and go out again on top of the next steps: the run trains every prompt."""
    with served(tmp_path, rows(tmp_path, rows=16), epochs=1) as (target, tasks):
        read = [[task.index["index"] for task in asyncio.run(tasks.read())] for _ in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's mean of the step's no pass rates
            report(tasks, read[0], set(read[0]))  # every run of every task failed
        with BufferClient(target) as admin:
            claimed = admin.ledger("grpo", "math").total("claimed")
        read.append([task.index["index"] for task in asyncio.run(tasks.read())])
        tasks.feedback({"experience_pipeline/experience_count": 0.0})  # step 1: no payload reached the pipeline
        read.append([task.index["index"] for task in asyncio.run(tasks.read())])
        for step in read[2:]:
            report(tasks, step, set())
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())  # the scheduler's 4 steps are done
        with BufferClient(target) as admin:
            info = admin.ledger("grpo", "math")
    assert claimed == BATCH  # step 1's, awaiting its feedback; step 0's were released
    assert read[2][:BATCH] == read[0] and read[3][:BATCH] == read[1]  # out again, on top of the next steps
    assert sorted(i for step in read[2:] for i in step) == list(range(16))
    assert (info.total("trained"), info.total("pending"), info.total("claimed")) == (16, 0, 0)


def test_a_max_in_flight_the_explorers_unreported_steps_fill_is_refused_by_name(tmp_path: Path) -> None:
    with served(tmp_path, rows(tmp_path, rows=SIZE), max_in_flight=BATCH) as (_, tasks):
        assert len(asyncio.run(tasks.read())) == BATCH
        with pytest.raises(ValueError, match=r"max_in_flight=4 and this explorer holds all 4 of its claims"):
            asyncio.run(tasks.read())  # its feedback comes only after this read: it would wait for ever


def test_a_steps_feedback_as_the_server_restarts_is_reported_and_the_run_trains_every_prompt(
    tmp_path: Path,
) -> None:
    """The server is away for 1.5 s as a step's feedback is reported: the report raised after gRPC's
    own retries and was logged, its claims renewed for hold_seconds (6 h by default), and the run
    ended with those prompts claimed and the dataset not done. The report waits for the server (for
    the client's timeout): every prompt is trained and none is left claimed."""
    with servers() as start:
        data = str(tmp_path / "data")
        server = start(data)
        port = server.port
        with BufferClient(server.target) as admin:
            admin.create_table("grpo", group_size=0, estimator="none")
        tasks = scheduler(server.target, rows(tmp_path, rows=2 * BATCH), {}, epochs=1)
        first = [task.index["index"] for task in asyncio.run(tasks.read())]
        assert server.stop(signal.SIGTERM) == 0
        restarted: list[ServerProcess] = []
        back = threading.Timer(1.5, lambda: restarted.append(start(data, "--port", str(port))))
        back.start()
        try:
            report(tasks, first, set())
        finally:
            back.join()
        second = [task.index["index"] for task in asyncio.run(tasks.read())]
        report(tasks, second, set())
        with pytest.raises(StopAsyncIteration):
            asyncio.run(tasks.read())
        with BufferClient(restarted[0].target) as admin:
            info = admin.ledger("grpo", "math")
    assert sorted(first + second) == list(range(2 * BATCH))
    assert info.done and (info.total("claimed"), info.total("trained")) == (0, 2 * BATCH)
