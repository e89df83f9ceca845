"""Trinity-RFT's data selector `expbuf` (issue 45), driven by Trinity's own TasksetScheduler over a
file taskset, against a real server on loopback: each step's tasks are the prompts an expbuf
dataset's claim order hands out, the experience pipeline's feedback trains them and updates their
statistics, and a curriculum survives restarts of the server and the explorer: the tasks after
each kill -9 are the ones a run without kills reads (skipped where trinity-rft is not installed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

trinity = pytest.importorskip("trinity")

from trinity.buffer.task_scheduler import TasksetScheduler, get_taskset_scheduler  # noqa: E402
from trinity.common.config import Config, DataSelectorConfig, TasksetConfig  # noqa: E402
from trinity.common.constants import SELECTOR_METRIC  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402

from helpers import ServerProcess, servers  # noqa: E402
from test_trinity_plugin import plugin  # noqa: E402, F401 - loads the plugin as Trinity does, for this module too
from trinity_explorer_child import WORKFLOW  # noqa: E402

SIZE, EPOCHS, BATCH = 16, 3, 4


def value(index: int) -> float:
    """A task's feedback (its runs' mean reward): every run passed, none, or half."""
    return {0: 1.0, 1: 0.0}.get(index % 4, 0.5)


def rows(tmp_path: Path) -> Path:
    directory = tmp_path / "rows"
    directory.mkdir(exist_ok=True)
    lines = [json.dumps({"question": f"what is {i}?", "answer": str(i)}) for i in range(SIZE)]
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def scheduler(target: str, source: Path, explorer_state: dict) -> TasksetScheduler:
    """Trinity's scheduler of a job whose file taskset names the selector `expbuf`: medium tasks
    first (the pools order, the easy and hard pools without a share)."""
    config = Config()
    config.buffer.batch_size, config.buffer.total_epochs = BATCH, EPOCHS
    kwargs = {
        "path": f"expbuf://{target}/grpo",
        "dataset": "math",
        "order": "pools",
        "order_options": {"easy_share": 0.0, "hard_share": 0.0},
        "pass_threshold": 0.25,
    }
    taskset = TasksetConfig(
        name="math", path=str(source), total_epochs=EPOCHS, batch_size=BATCH, enable_progress_bar=False,
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
    source = rows(tmp_path)
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
