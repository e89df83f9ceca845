"""A Trinity-RFT taskset read from an expbuf dataset of prompts (the prompt ledger), driven by
Trinity's own classes (its config loader and check, its taskset scheduler and file reader, its
workflows, its experience pipeline, its explorer checkpoint) against a real server on loopback:
the explorer's loop takes its prompts from the ledger, each prompt's group reaches the table
under the prompt's EID, and an explorer killed with SIGKILL gives its claimed prompts back, so
that over the restarts no prompt is skipped or trained twice (skipped where trinity-rft is not
installed)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from expbuf.client import BufferClient
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL, Claim
from expbuf.server.app import ExpbufServer

from conftest import Servers
from pages import code_blocks, page
from test_trinity_plugin import plugin  # noqa: F401 - loads the plugin as Trinity does, for this module too
from trinity_explorer_child import WORKFLOW, explore


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity, OmegaConf, Config, DataSelectorConfig, ExperienceBufferConfig, TasksetConfig, load_config
    global EID, Experience, ExpbufTaskset, plugin_dir, ClaimKeeper
    import test_trinity_plugin

    test_trinity_plugin.import_frameworks()
    import trinity_explorer_child

    trinity_explorer_child.import_frameworks()
    trinity = pytest.importorskip("trinity")
    from omegaconf import OmegaConf
    from trinity.common.config import (
        Config,
        DataSelectorConfig,
        ExperienceBufferConfig,
        TasksetConfig,
        load_config,
    )
    from trinity.common.experience import EID, Experience

    from expbuf.client.trinity import ExpbufTaskset, plugin_dir
    from expbuf.client.trinity.claims import ClaimKeeper


TABLE, DATASET, SIZE, EPOCHS = "grpo8", "math", 6, 2
PAGE = "frameworks/trinity.md"  # the docs page of Trinity-RFT, whose taskset job this runs
PAGE_ADDRESS, PAGE_SOURCE = "10.0.0.5:50051", "/data/math"
CHILD = Path(__file__).parent / "trinity_explorer_child.py"


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server()


@pytest.fixture
def admin(server: ExpbufServer) -> Iterator[BufferClient]:
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table(TABLE, group_by="task", group_size=0, estimator="grpo")
        yield client


def source(tmp_path: Path, rows: int = SIZE) -> Path:
    """The user's own taskset: one row per prompt, its answer its index."""
    directory = tmp_path / "rows"
    directory.mkdir(exist_ok=True)
    lines = [json.dumps({"question": f"what is {i}?", "answer": str(i)}) for i in range(rows)]
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def page_taskset() -> str:
    """The page's taskset job: the YAML block that names a dataset."""
    (block,) = [b for b in code_blocks(page(PAGE), "yaml") if "dataset=" in b]
    return block


def job(server: ExpbufServer, tmp_path: Path, lease_seconds: float = 5.0) -> Path:
    """The page's taskset job on this machine (its rows in tmp_path, claims of `lease_seconds`),
    with the rest of an explore-mode Trinity job, written where Trinity loads it from."""
    address = f"127.0.0.1:{server.port}"
    shown = page_taskset().replace(PAGE_ADDRESS, address).replace(PAGE_SOURCE, str(source(tmp_path)))
    rest = {
        "project": "expbuf",
        "name": "ledger",
        "mode": "explore",
        "checkpoint_root_dir": str(tmp_path / "checkpoints"),
        "model": {"model_path": str(tmp_path), "max_model_len": 4096},
        "cluster": {"node_num": 1, "gpu_per_node": 8},  # Ray counts no GPUs on a CPU machine
        "algorithm": {"algorithm_type": "grpo", "advantage_fn": "expbuf", "repeat_times": 2},
        "data_processor": {"experience_pipeline": {"save_input": False}},
        "buffer": {
            "trainer_input": {"experience_buffer": {"name": "experiences", "path": f"expbuf://{address}/{TABLE}"}},
        },
    }
    merged = OmegaConf.to_container(OmegaConf.merge(rest, yaml.safe_load(shown)))
    merged["buffer"]["batch_size"] = 2  # tasks an explore step reads
    taskset = merged["buffer"]["explorer_input"]["taskset"]
    taskset["default_workflow_type"] = WORKFLOW
    taskset["path"] += f"&lease_seconds={lease_seconds}"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(merged))
    return path


def page_dataset(client: BufferClient) -> None:
    """The dataset as the page's command creates it, for this job's rows."""
    command = re.search(r"expbuf dataset create (\S+) (\S+) (\d+) (.*)", page(PAGE))
    assert command is not None and command.group(1, 2) == (TABLE, DATASET)
    settings = dict(word.split("=") for word in command.group(4).split("#")[0].split())
    client.create_dataset(TABLE, DATASET, SIZE, **{key: int(value) for key, value in settings.items()})


def loaded(path: Path) -> Config:
    config = load_config(str(path))
    config.check_and_update()
    return config


def train(server: ExpbufServer) -> list[Experience]:
    """A trainer reading every group through the plugin's reader until the ledger is done."""
    config = ExperienceBufferConfig(
        name="experiences",
        path=f"expbuf://127.0.0.1:{server.port}/{TABLE}?delivery=consume",
        batch_size=4,
        max_read_timeout=30,
    )
    reader = trinity.buffer.get_buffer_reader(config)
    read: list[Experience] = []
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        while not client.ledger(TABLE, DATASET).done:
            read += asyncio.run(reader.read())
    reader.close()
    return read


def prompts_of(read: list[Experience]) -> Counter[tuple[int, int]]:
    """Each group read, by (epoch, index) of its prompt (EID batch math/EPOCH, task INDEX@ATTEMPT)."""
    groups = {exp.eid.tid for exp in read}
    pairs = []
    for tid in groups:
        match = re.fullmatch(rf"{DATASET}/(\d+)/(\d+)@(\d+)", tid)
        assert match is not None, tid
        pairs.append((int(match.group(1)), int(match.group(2))))
    return Counter(pairs)


def check_rows(read: list[Experience]) -> None:
    """Each experience answers its prompt's row of the source (the workflow puts the row's answer
    in the last token), and carries the task's index Trinity copies into its info."""
    for exp in read:
        index = int(str(exp.eid.task).split("@")[0])
        assert int(exp.tokens[-1]) == 4 + index
        assert exp.info["task_index"]["index"] == index


def test_the_explorers_loop_takes_its_prompts_from_the_ledger(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path
) -> None:
    page_dataset(admin)
    config = loaded(job(server, tmp_path))
    steps: list[str] = []
    last = SIZE * EPOCHS // 2
    assert asyncio.run(explore(config, steps.append)) == last
    # the read after the last step ended the loop with two steps unwritten (their claims its own)
    assert steps[-5].startswith(f"read {last} ")
    assert steps[-4:] == [f"wrote {last - 2}", f"wrote {last - 1}", f"wrote {last}", "done"]
    handed = [prompt for line in steps if line.startswith("read ") for prompt in line.split()[2:]]
    seeded = [f"{DATASET}/{p.epoch}/{p.index}@0" for p in admin.list_prompts(TABLE, DATASET).prompts]
    assert sorted(handed) == sorted(seeded) and len(handed) == SIZE * EPOCHS
    first = [int(prompt.split("/")[2].split("@")[0]) for prompt in handed[:SIZE]]
    assert sorted(first) == list(range(SIZE)) and first != list(range(SIZE))  # the dataset's seeded order
    info = admin.ledger(TABLE, DATASET)
    assert (info.total("generated"), info.total("claimed"), info.total("pending")) == (SIZE * EPOCHS, 0, 0)

    read = train(server)
    assert prompts_of(read) == Counter({(e, i): 1 for e in range(EPOCHS) for i in range(SIZE)})
    assert len(read) == SIZE * EPOCHS * 2  # two runs a group, none lost
    check_rows(read)
    info = admin.ledger(TABLE, DATASET)
    assert info.done and [c.trained for c in info.counts] == [SIZE] * EPOCHS

    again: list[str] = []  # the next run of the explorer: the ledger says done, its loop ends at once
    asyncio.run(explore(loaded(job(server, tmp_path)), again.append))
    assert again == ["done"]


def run_explorer(config: Path, log: Path, die_at: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "TRINITY_PLUGIN_DIRS": plugin_dir()}
    args = [sys.executable, str(CHILD), str(config), str(log), *([str(die_at)] if die_at else [])]
    with open(log.with_suffix(".err"), "a") as err:  # a file: a full pipe would stall the child
        return subprocess.Popen(args, stderr=err, stdout=err, env=env)


def wait_for(check: Callable[[], bool], what: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def reads(log: Path) -> list[list[str]]:
    """The prompts of each `read` line of an explorer's log."""
    return [line.split()[2:] for line in log.read_text().splitlines() if line.startswith("read ")]


def writes(log: Path) -> list[int]:
    """The steps of each `wrote` line of an explorer's log."""
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("wrote ")]


def test_an_explorer_killed_mid_step_gives_its_prompts_back_and_none_is_skipped_or_trained_twice(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path
) -> None:
    page_dataset(admin)
    config = job(server, tmp_path)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = run_explorer(config, first_log, die_at=3)
    try:
        wait_for(lambda: "ready" in first_log.read_text() if first_log.exists() else first.poll() is not None, "step 3")
        assert first.poll() is None, first_log.with_suffix(".err").read_text()[-3000:]
        assert writes(first_log) == [1]  # steps 2 and 3 are in flight, their claims held
        written, held = reads(first_log)[:1], reads(first_log)[1] + reads(first_log)[2]
        claimed = admin.list_prompts(TABLE, DATASET, states=["claimed"]).prompts
        assert sorted(p.group for p in claimed) == sorted(held) and len(held) == 4
        before = {p.group: p.expires for p in claimed}
        wait_for(  # the explorer renews its claims while it lives
            lambda: all(
                p.expires > before[p.group] for p in admin.list_prompts(TABLE, DATASET, states=["claimed"]).prompts
            ),
            "a renewal",
        )
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    info = admin.ledger(TABLE, DATASET)
    assert info.total("generated") == 2  # the step the explorer wrote
    wait_for(lambda: admin.ledger(TABLE, DATASET).reissued == 4, "the killed explorer's claims to end")

    second = run_explorer(config, second_log)  # the restart, from Trinity's explorer checkpoint
    assert second.wait(300) == 0, second_log.with_suffix(".err").read_text()[-3000:]
    again = reads(second_log)
    assert sorted(again[0] + again[1]) == sorted(group.replace("@0", "@1") for group in held)  # sent back, first
    done_before = {group for step in written for group in step}
    handed_after = [group for step in again for group in step]
    assert len(handed_after) == SIZE * EPOCHS - len(done_before)
    assert not {g.split("@")[0] for g in handed_after} & {g.split("@")[0] for g in done_before}  # none twice

    read = train(server)
    assert prompts_of(read) == Counter({(e, i): 1 for e in range(EPOCHS) for i in range(SIZE)})  # none skipped
    check_rows(read)
    info = admin.ledger(TABLE, DATASET)
    assert info.done and [c.trained for c in info.counts] == [SIZE] * EPOCHS
    assert (info.total("dropped"), info.reissued, info.attempts_dropped) == (0, 4, 0)


# ---- what the plugin's taskset refuses, by name ------------------------------------------------------


def taskset_config(server: ExpbufServer, tmp_path: Path, query: str, **settings: object) -> TasksetConfig:
    path = f"expbuf://127.0.0.1:{server.port}/{TABLE}?{query}".replace("SOURCE", str(source(tmp_path)))
    settings = {"batch_size": 2, "total_epochs": EPOCHS, "default_workflow_type": WORKFLOW, **settings}
    return TasksetConfig(name="math", path=path, **settings)


def test_what_a_taskset_on_expbuf_cannot_be_is_refused_by_name(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path
) -> None:
    get = trinity.buffer.get_buffer_reader
    with pytest.raises(ValueError, match=r"no dataset 'math'.*expbuf dataset create grpo8 math 6 epochs=2"):
        get(taskset_config(server, tmp_path, "dataset=math&source=SOURCE"))
    admin.create_dataset(TABLE, DATASET, SIZE + 1, epochs=EPOCHS)
    with pytest.raises(ValueError, match=r"has 7 prompts and its source .* 6 rows"):
        get(taskset_config(server, tmp_path, "dataset=math&source=SOURCE"))
    admin.create_dataset(TABLE, "two", SIZE)
    with pytest.raises(ValueError, match=r"epochs=1 and buffer.total_epochs is 2"):
        get(taskset_config(server, tmp_path, "dataset=two&source=SOURCE"))
    for query, settings, message in [
        ("", {}, r"reads a dataset of prompts; name it and its rows"),
        ("dataset=two", {}, "dataset=NAME and source=PATH go together"),
        ("dataset=two&source=SOURCE", {"total_epochs": 1, "total_steps": 3}, "total_steps=3"),
        ("dataset=two&source=SOURCE", {"total_epochs": 1, "is_eval": True}, "eval taskset"),
        (
            "dataset=two&source=SOURCE",
            {"total_epochs": 1, "data_selector": DataSelectorConfig(selector_type="shuffle")},
            "data_selector shuffle: the dataset orders its prompts",
        ),
        ("dataset=two&source=SOURCE&hold_seconds=0", {"total_epochs": 1}, "hold_seconds='0' must be a number > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            get(taskset_config(server, tmp_path, query, **settings))
    taskset = get(taskset_config(server, tmp_path, "dataset=two&source=SOURCE", total_epochs=1))
    assert isinstance(taskset, ExpbufTaskset) and len(taskset) == SIZE
    taskset.close()
    with pytest.raises(ValueError, match=r"a taskset on expbuf is read from a dataset of prompts .*never written"):
        trinity.buffer.get_buffer_writer(taskset_config(server, tmp_path, "dataset=two&source=SOURCE"))
    experiences = ExperienceBufferConfig(
        name="experiences", path=f"expbuf://127.0.0.1:{server.port}/{TABLE}?dataset=two&source=x"
    )
    with pytest.raises(ValueError, match="dataset= and source= name a taskset's prompts"):
        trinity.buffer.get_buffer_reader(experiences)


def read_within(taskset: ExpbufTaskset, seconds: float = 120.0) -> list | BaseException:
    """A read's tasks, or what it raised; a read that waits for ever fails the test instead of
    holding it (the read goes on in its thread until the taskset is closed)."""
    outcome: list[list | BaseException] = []

    def read() -> None:
        try:
            outcome.append(asyncio.run(taskset.read()))
        except BaseException as exc:  # the outcome is the test's, in the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    if not outcome:
        taskset.close()
        raise AssertionError("the read still waits")
    return outcome[0]


def test_a_max_in_flight_the_explorers_own_unwritten_steps_fill_is_refused_by_name(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path
) -> None:
    """Trinity writes a step after its next read: when that read finds the dataset's max_in_flight
    full of the explorer's own claims, nothing can make room, and the read says so instead of
    waiting for ever."""
    admin.create_dataset(TABLE, DATASET, SIZE, epochs=EPOCHS, max_in_flight=2)
    taskset = trinity.buffer.get_buffer_reader(taskset_config(server, tmp_path, "dataset=math&source=SOURCE"))
    assert len(asyncio.run(taskset.read())) == 2
    outcome = read_within(taskset)
    taskset.close()
    with pytest.raises(ValueError, match=r"max_in_flight=2 and this explorer holds all 2 of its claims"):
        raise outcome if isinstance(outcome, BaseException) else AssertionError(outcome)


def groups(tasks: list) -> list[str]:
    return [f"{task.index['expbuf']['batch']}/{task.index['expbuf']['task']}" for task in tasks]


def test_explorers_sharing_a_dataset_end_together_and_wait_for_a_rollout_workers_claims(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path
) -> None:
    """Two explorers read one dataset. At its end each holds the claims of steps it writes only
    after its loop ends, so neither waits for the other's; a rollout worker's claims are waited
    for, since their prompts may come back, and then go to the explorer that waited."""
    admin.create_dataset(TABLE, DATASET, SIZE)
    config = taskset_config(server, tmp_path, "dataset=math&source=SOURCE", total_epochs=1)
    first, second = trinity.buffer.get_buffer_reader(config), trinity.buffer.get_buffer_reader(config)
    worker = admin.claim(TABLE, DATASET, 2, lease_seconds=600, owner="rollout-worker-1").prompts
    handed = groups(asyncio.run(first.read())) + groups(asyncio.run(second.read()))
    assert admin.ledger(TABLE, DATASET).total("pending") == 0

    claims, waited = Counter[str](), threading.Event()  # the read found nothing to claim, and claimed again
    claim = first._client.claim

    def claiming(*args: Any, **kwargs: Any) -> Claim:
        claims["calls"] += 1
        if claims["calls"] == 2:
            waited.set()
        return claim(*args, **kwargs)

    first._client.claim = claiming  # type: ignore[method-assign]
    outcome: list[list | BaseException] = []
    reader = threading.Thread(target=lambda: outcome.append(read_within(first)), daemon=True)
    reader.start()
    assert waited.wait(120), "the read did not wait for the worker's claims"
    assert admin.release_claims(worker) == 2  # the worker gives its prompts back
    reader.join(150)
    assert outcome and not isinstance(outcome[0], BaseException), outcome
    assert sorted(groups(outcome[0])) == sorted(p.group.replace("@0", "@1") for p in worker)
    handed += groups(outcome[0])

    for explorer in (first, second):  # every claim now an explorer's: each loop ends
        assert isinstance(read_within(explorer), StopAsyncIteration)
    assert sorted(g.split("@")[0] for g in handed) == sorted(f"{DATASET}/0/{i}" for i in range(SIZE))
    assert admin.ledger(TABLE, DATASET).total("claimed") == SIZE
    first.close()
    second.close()


def test_a_step_written_after_one_of_its_claims_ended_keeps_the_other_groups(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A task that outlasted its claim: its prompt went out again, and the write of its step holds a
    group of the ended attempt, which the server refuses. The step's other groups are written."""
    admin.create_dataset(TABLE, DATASET, SIZE, epochs=EPOCHS)
    taskset = trinity.buffer.get_buffer_reader(taskset_config(server, tmp_path, "dataset=math&source=SOURCE"))
    tasks = asyncio.run(taskset.read())
    assert len(tasks) == 2
    late = admin.list_prompts(TABLE, DATASET, states=["claimed"]).prompts[0]
    assert admin.release_claims([late]) == 1  # as if its claim had ended
    writer = trinity.buffer.get_buffer_writer(
        ExperienceBufferConfig(name="experiences", path=f"expbuf://127.0.0.1:{server.port}/{TABLE}")
    )
    step = [
        Experience(
            eid=EID(batch=7, task=i, run=run),
            tokens=torch.tensor([1, 2, 3, 4]),
            prompt_length=3,
            reward=float(run),
            info={"task_index": task.index},
        )
        for i, task in enumerate(tasks)
        for run in range(2)
    ]
    with caplog.at_level(logging.WARNING):
        asyncio.run(writer.write(step))
    assert late.group in caplog.text and "whose claim ended" in caplog.text
    (kept,) = [task.index["expbuf"] for task in tasks if task.index["expbuf"]["task"] != late.task]
    listed = admin.list_experiences(TABLE).experiences
    assert {e.group_id for e in listed} == {f"{kept['batch']}/{kept['task']}"} and len(listed) == 2
    info = admin.ledger(TABLE, DATASET)
    assert (info.total("generated"), info.total("claimed"), info.reissued) == (1, 0, 1)
    taskset.close()


def test_a_task_whose_runs_all_failed_goes_out_again_once_its_steps_feedback_comes(
    server: ExpbufServer, admin: BufferClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trinity's scheduler of one taskset (SimpleTasksetScheduler, whose own feedback does nothing)
    reads a step of two tasks; one makes its group, the other's every run failed, so its step's write
    holds nothing of it. Once the step's feedback comes (its experiences written), that prompt's claim
    is released and the next read hands it out again, at its next attempt, where its claim was kept
    for `hold_seconds` (6 hours by default) and, at the run's end, the prompt went untrained."""
    from trinity.buffer.task_scheduler import SimpleTasksetScheduler, get_taskset_scheduler

    admin.create_dataset(TABLE, DATASET, SIZE, epochs=EPOCHS)
    tasks = get_taskset_scheduler({}, loaded(job(server, tmp_path)))
    assert isinstance(tasks, SimpleTasksetScheduler)
    first = asyncio.run(tasks.read())
    made, failed = (task.index["expbuf"] for task in first)
    writer = trinity.buffer.get_buffer_writer(
        ExperienceBufferConfig(name="experiences", path=f"expbuf://127.0.0.1:{server.port}/{TABLE}")
    )
    step = [
        Experience(
            eid=EID(batch=1, task=0, run=run),
            tokens=torch.tensor([1, 2, 3, 4]),
            prompt_length=3,
            reward=float(run),
            info={"task_index": first[0].index},
        )
        for run in range(2)
    ]
    asyncio.run(writer.write(step))
    second = asyncio.run(tasks.read())  # Trinity reads the next step before it writes this one
    claimed = {f"{p.batch}/{p.task}" for p in admin.list_prompts(TABLE, DATASET, states=["claimed"]).prompts}
    assert f"{failed['batch']}/{failed['task']}" in claimed
    with caplog.at_level(logging.WARNING):
        tasks.feedback({})  # the explorer's, once the step's experiences are written
    assert f"{failed['batch']}/{failed['task']}" in caplog.text and "made no complete group" in caplog.text
    listed = admin.list_prompts(TABLE, DATASET, states=["claimed"]).prompts
    assert {f"{p.batch}/{p.task}" for p in listed} == {
        f"{t.index['expbuf']['batch']}/{t.index['expbuf']['task']}" for t in second
    }  # the next step's claims stay: its feedback has not come
    again = asyncio.run(tasks.read())[0].index["expbuf"]
    assert again["batch"] == failed["batch"] and again["task"].split("@") == [failed["task"].split("@")[0], "1"]
    assert made["task"] not in {t.index["expbuf"]["task"] for t in [*second]}
    info = admin.ledger(TABLE, DATASET)
    assert (info.total("generated"), info.reissued) == (1, 1)
    tasks.reader.close()


def test_claims_are_let_go_once_held_too_long(server: ExpbufServer, admin: BufferClient) -> None:
    """A task that never made a group (every run failed) holds its claim at most `hold` seconds."""
    admin.create_dataset(TABLE, DATASET, SIZE)
    now = [0.0]
    keeper = ClaimKeeper(BufferClient(f"127.0.0.1:{server.port}"), seconds=2.0, hold=100.0, clock=lambda: now[0])
    claim = admin.claim(TABLE, DATASET, 2, lease_seconds=2.0)
    keeper.hold(claim.prompts)
    assert keeper.held() == claim.prompts
    now[0] = 100.0  # held that long: the keeper renews them no more, and they end
    assert keeper.held() == []
    wait_for(lambda: admin.ledger(TABLE, DATASET).reissued == 2, "the claims to end")
    keeper.close()


def test_the_keeper_renews_more_claims_than_one_call_may_name(server: ExpbufServer, admin: BufferClient) -> None:
    """A reader holding more claims than one RenewClaims may name (several steps' tasks) renews
    them all, in calls of at most MAX_PROMPTS_PER_CALL."""
    admin.create_dataset(TABLE, "wide", MAX_PROMPTS_PER_CALL + 1)
    keeper = ClaimKeeper(BufferClient(f"127.0.0.1:{server.port}", timeout=30), seconds=600.0, hold=3600.0)
    held = [p for n in (MAX_PROMPTS_PER_CALL, 1) for p in admin.claim(TABLE, "wide", n, lease_seconds=60).prompts]
    keeper.hold(held)
    assert keeper.held() == held  # renewed now: none had ended
    page = admin.list_prompts(TABLE, "wide", states=["claimed"], limit=10)
    assert len(page.prompts) == 10 and min(p.expires for p in page.prompts) > max(p.expires for p in held) + 500
    keeper.close()


def test_a_read_as_the_server_restarts_waits_for_it(start_server: Servers, tmp_path: Path) -> None:
    """The server is away for 1.5 s as the explorer reads its next step: the claim raised UNAVAILABLE
    after gRPC's own retries, and Trinity's explorer ended its loop on it, the epoch unfinished.
    The read waits for the server (for the client's timeout) and takes the next prompts."""
    server = start_server()
    port = server.port
    with BufferClient(f"127.0.0.1:{port}") as client:
        client.create_table(TABLE, group_by="task", group_size=0, estimator="grpo")
        client.create_dataset(TABLE, DATASET, SIZE)
    taskset = trinity.buffer.get_buffer_reader(
        taskset_config(server, tmp_path, f"dataset={DATASET}&source=SOURCE", total_epochs=1)
    )
    first = [task.index["index"] for task in asyncio.run(taskset.read())]
    start_server.stop(server)
    restarted: list[ExpbufServer] = []
    back = threading.Timer(1.5, lambda: restarted.append(start_server(port=port)))
    back.start()
    try:
        second = [task.index["index"] for task in asyncio.run(taskset.read())]
    finally:
        back.join()
        taskset.close()
    assert len(first) == len(second) == 2 and not set(first) & set(second)
