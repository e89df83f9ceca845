"""Partial rollouts (issue 44): a rollout pushed in pieces as it is generated is held durably, never
served, and put together into the experience pushed whole when its last piece comes; a piece that
does not follow is refused by name; a rollout worker killed with SIGKILL mid-rollout leaves its
pieces to the prompt's next claimant, who continues them, and the group trains once."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import lmdb
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import EID, AsyncBufferClient, BufferClient, Experience, InvalidArgumentError, TrxpError, trxp
from expbuf.client.errors import (
    AlreadyExistsError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from expbuf.client.rollout_pieces import continuation, split
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Store
from expbuf.server.store.core.table_state.counters import read_counters, write_counters
from expbuf.server.store.disk import chunked, layout
from expbuf.server.store.disk.kinds import Entry, Push
from expbuf.server.store.schema.errors import Conflict, Damaged, DamagedPiece, GroupClosed, GroupOverfilled
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import make_experience, scrape, servers, serving
from test_store import Clock

PROMPT, RESPONSE = 5, 12


def rollout(task: int | str = 0, run: int = 0, batch: int | str = 0, reward: float = 1.0) -> Experience:
    """A long rollout as a worker has it at its end: tokens of three policy versions, a tool's
    reply masked out, routing ids per token."""
    length = PROMPT + RESPONSE
    mask = torch.ones(RESPONSE, dtype=torch.bool)
    mask[6:8] = False
    return Experience(
        eid=EID(batch=batch, task=task, run=run, suffix="r"),
        tokens=torch.arange(100, 100 + length, dtype=torch.int32) + run,
        prompt_length=PROMPT,
        logprobs=-torch.arange(RESPONSE, dtype=torch.float32) / 10 - run,
        action_mask=mask,
        routed_experts=torch.arange(length * 2, dtype=torch.uint8).reshape(length, 2),
        reward=reward,
        prompt_text="a question",
        info={"model_version": 3, "version_segments": [[3, 0], [4, 5], [6, 9]], "agent": "math"},
    )


def same(got: Experience, want: Experience) -> None:
    for name in ("tokens", "logprobs", "action_mask", "routed_experts"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.prompt_length, got.reward, got.prompt_text) == (want.prompt_length, want.reward, want.prompt_text)
    assert got.info == want.info


def test_split_cuts_a_rollout_as_the_buffer_puts_it_together() -> None:
    first, second, last = split(rollout(), [4, 8])
    assert (first.prompt_length, first.tokens.numel(), first.info) == (
        PROMPT,
        PROMPT + 4,
        {"partial": True, "version_segments": [[3, 0]]},
    )
    assert second.info == {"partial": True, "partial_offset": PROMPT + 4, "version_segments": [[3, 0], [4, 1]]}
    assert second.prompt_length == 0 and second.routed_experts.shape == (4, 2)
    assert last.info["partial_offset"] == PROMPT + 8 and last.info["version_segments"] == [[4, 0], [6, 1]]
    with pytest.raises(ValueError, match="must increase strictly"):
        split(rollout(), [4, 4])


def test_a_rollout_in_three_pieces_equals_it_pushed_whole_and_no_piece_is_served(client: BufferClient) -> None:
    # DAPO's overlong penalty reads each run's generated tokens, the finished rollout's (10 under its mask: 1.0 - 1/3),
    # not its last piece's (4: no penalty): the partner's 0.8 ranks above it, not below
    shaping = {"overlong_buffer": True, "overlong_buffer_len": 3, "max_new_tokens": 12}
    partner = make_experience(0, 0, 1, response=4, reward=0.8)
    for table in ("whole", "pieces"):
        client.create_table(table, group_size=2, shaping=shaping)
    client.push([rollout(run=0), partner], table="whole")
    first, second, last = split(rollout(run=0), [4, 8])
    assert client.push([first], table="pieces").partial == [first.eid.uid]
    done = client.push([second], table="pieces")
    assert (done.stored, done.partial, done.completed_groups) == ([], [second.eid.uid], [])
    assert client.push([second], table="pieces").duplicates == [second.eid.uid]  # sent again: nothing changes
    with pytest.raises(DeadlineExceededError, match="did not have 1 group ready"):
        next(client.sample("pieces", num_groups=1, max_batches=1, timeout=0.5, delivery="replay"))
    (held,) = client.get_partials(["0/0"], table="pieces")  # the rollout so far
    whole = rollout(run=0)
    assert held.info["partial"] is True and torch.equal(held.tokens, whole.tokens[: PROMPT + 8])
    assert torch.equal(held.logprobs, whole.logprobs[:8]) and held.info["version_segments"] == [[3, 0], [4, 5]]
    stats = client.stats("pieces")["pieces"]
    assert (stats.pending, stats.pushed, stats.groups_pending) == (0, 0, 1)  # a rollout in pieces is no experience
    done = client.push([last, partner], table="pieces")  # with its group's other run
    assert (done.stored, done.completed_groups) == ([last.eid.uid, partner.eid.uid], ["0/0"])
    assert client.get_partials(["0/0"], table="pieces") == []
    assert client.push([last], table="pieces").duplicates == [last.eid.uid]
    got = {}
    for table in ("whole", "pieces"):
        (batch,) = client.sample(table, num_groups=1, max_batches=1, timeout=10, delivery="consume")
        got[table] = {e.eid.uid: e for e in batch.experiences}
    assert float(got["whole"][last.eid.uid].advantages[0]) < 0
    same(got["pieces"][last.eid.uid], got["whole"][last.eid.uid])
    for uid, want in got["whole"].items():
        assert torch.equal(got["pieces"][uid].advantages, want.advantages)


def test_pieces_that_do_not_follow_are_refused_by_name_and_store_nothing(client: BufferClient, server) -> None:
    client.create_table("t", group_size=2)
    first, second, last = split(rollout(), [4, 8])
    with pytest.raises(AlreadyExistsError, match="continues at token 9, but the buffer holds 0 of its tokens"):
        client.push([second], table="t")
    client.push([first], table="t")
    with pytest.raises(AlreadyExistsError, match="continues at token 13, but the buffer holds 9"):
        client.push([last], table="t")
    lacking = split(rollout(), [4, 8])[1]
    lacking.routed_experts = None
    with pytest.raises(InvalidArgumentError, match="lacks routed_experts, which the first piece has"):
        client.push([lacking], table="t")
    wrong = split(rollout(), [4, 8])[1]
    wrong.logprobs = wrong.logprobs.to(torch.float64)
    with pytest.raises(InvalidArgumentError, match="field 'logprobs' is F64 of inner shape"):
        client.push([wrong], table="t")
    unversioned = split(rollout(), [4, 8])[1]
    del unversioned.info["version_segments"]
    with pytest.raises(
        InvalidArgumentError, match="with every piece of a rollout that has response tokens, or with none"
    ):
        client.push([unversioned], table="t")
    older = split(rollout(), [4, 8])[1]
    older.info["version_segments"] = [[2, 0]]
    with pytest.raises(InvalidArgumentError, match="starts at version 2, older than the rollout's last"):
        client.push([older], table="t")
    with_prompt = split(rollout(), [4, 8])[1]
    with_prompt.prompt_length = 1
    with pytest.raises(TrxpError, match="its prompt_length must be 0"):
        client.push([with_prompt], table="t")
    (held,) = client.get_partials(["0/0"], table="t")
    assert held.tokens.numel() == PROMPT + 4  # the first piece alone
    assert client.push([second], table="t").partial == [second.eid.uid]  # the server is healthy
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_partials", (("table", "t"),))] == 1
    assert metrics[("expbuf_pieces_pushed_total", (("table", "t"),))] == 2


def test_a_group_that_completes_without_a_rollout_in_pieces_drops_it(client: BufferClient) -> None:
    client.create_table("t", group_size=3, min_group_size=2, estimator="none")
    first, _, _ = split(rollout(run=2), [4, 8])
    client.push([rollout(run=0), rollout(run=1, reward=0.0), first], table="t")
    done = client.fail_runs([first.eid.uid], "t", reasons=["sandbox died"])
    assert done.completed_groups == ["0/0"]
    assert client.get_partials(["0/0"], table="t") == []
    assert client.stats("t")["t"].ready == 2
    with pytest.raises(FailedPreconditionError, match="already complete"):
        client.push([split(rollout(run=2), [4, 8])[0]], table="t")


@pytest.mark.usefixtures("table_layout")
@pytest.mark.parametrize(("group_size", "reason"), [(2, "group_overfilled"), (0, "group_closed")])
def test_a_push_that_completes_a_group_refuses_a_piece_of_a_run_past_it(
    start_server: Servers, group_size: int, reason: str
) -> None:
    """A push that finished a group's last run and carried a first piece of another run of that
    group answered the piece in `partial` (durable) and dropped it in the same commit, as a
    group's completion drops its runs in pieces: the worker's next piece was refused GroupClosed,
    and get_partials had nothing of it. With group_size 0 the piece was held, and so were its
    next pieces, but its last piece was refused GroupClosed: the rollout could never be stored.
    Such a push is refused naming the group and the rollout, nothing of it stored, and so is a
    later piece of a run of a complete group; a piece of another group's run in a push that
    completes a group is held."""
    server = start_server()
    first, second, last = split(rollout(run=2), [4, 8])
    elsewhere = split(rollout(task=1, run=0), [4, 8])[0]
    rest = [rollout(run=1)] if group_size else [rollout(run=0), rollout(run=1)]
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=group_size, estimator="none")
        if group_size:
            client.push([rollout(run=0)], table="t")
        with pytest.raises(FailedPreconditionError, match="0/0/2/0/r") as refused:
            client.push([*rest, first], table="t")
        assert refused.value.reason == reason
        assert "group 0/0" in refused.value.details and "nothing of this push is stored" in refused.value.details
        stats = client.stats("t")["t"]
        assert (stats.live, stats.groups_pending) == ((1, 1) if group_size else (0, 0))
        assert client.get_partials(["0/0"], table="t") == []
        result = client.push([*rest, elsewhere], table="t")
        assert (result.stored, result.partial) == ([exp.eid.uid for exp in rest], ["0/1/0/0/r"])
        assert result.completed_groups == ["0/0"]
        assert [exp.eid.uid for exp in client.get_partials(["0/1"], table="t")] == ["0/1/0/0/r"]
        for piece in (first, second, last):
            with pytest.raises(FailedPreconditionError, match="already complete"):
                client.push([piece], table="t")
        assert scrape(server.metrics_port)[("expbuf_partials", (("table", "t"),))] == 1
    assert server.store.verify("t") == []


WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from expbuf.client import BufferClient
    from expbuf.client.rollout_pieces import split
    from test_partial_rollouts import rollout

    with BufferClient({target!r}) as client:
        (prompt,) = client.claim("t", "d", 1, lease_seconds=2.0, wait=30).prompts
        pieces = split(rollout(prompt.task, 0, prompt.batch), [4, 8])
        client.push(pieces[:2], table="t")  # two pieces of run 0, durable; then it is killed
        print(prompt.batch, prompt.task, flush=True)
        time.sleep(600)
    """
)


def test_a_worker_killed_mid_rollout_leaves_its_pieces_to_the_next_claimant_and_the_group_trains_once(
    start_server: Servers, tmp_path: Path
) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("t", group_size=2)
        client.create_dataset("t", "d", 1)
        script = WORKER.format(tests=str(Path(__file__).parent), target=target)
        worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            batch, task = worker.stdout.readline().split()  # its pieces are acknowledged
            worker.send_signal(signal.SIGKILL)
        finally:
            worker.kill()
            worker.wait(30)
        assert task.endswith("@0")
        deadline = time.monotonic() + 60
        claimed = []
        while not claimed and time.monotonic() < deadline:  # the killed worker's claim ends after 2 s
            claimed = client.claim("t", "d", 1, lease_seconds=60, wait=5).prompts
        (prompt,) = claimed
        assert prompt.attempt == 1 and prompt.batch == batch
        (held,) = client.get_partials([f"{prompt.batch}/{prompt.task}"], table="t")  # under its own task
        assert held.eid.uid == prompt.eid(0, suffix="r").uid and held.tokens.numel() == PROMPT + 8
        whole = rollout(prompt.task, 0, prompt.batch)
        rest = continuation(
            held,
            whole.tokens[PROMPT + 8 :],
            logprobs=whole.logprobs[8:],
            action_mask=whole.action_mask[8:],
            routed_experts=whole.routed_experts[PROMPT + 8 :],
            version_segments=[[4, 0], [6, 1]],
            reward=whole.reward,
            prompt_text=whole.prompt_text,
            info={key: value for key, value in whole.info.items() if key != "version_segments"},
        )
        done = client.push([rest, rollout(prompt.task, 1, prompt.batch, reward=0.0)], table="t")
        assert done.completed_groups == [f"{prompt.batch}/{prompt.task}"]
        (trained,) = client.sample("t", num_groups=1, max_batches=1, timeout=10, delivery="lease")
        assert {e.eid.uid: e.eid.run for e in trained.experiences} == {
            prompt.eid(0, suffix="r").uid: 0,
            prompt.eid(1, suffix="r").uid: 1,
        }
        same(next(e for e in trained.experiences if e.eid.run == 0), whole)
        assert trained.ack() == 2
        with pytest.raises(DeadlineExceededError, match="did not have 1 group ready"):
            next(client.sample("t", num_groups=1, max_batches=1, timeout=0.5))
        prompts = client.list_prompts("t", "d").prompts
        assert [(p.state, p.attempt) for p in prompts] == [("trained", 1)]


def test_a_group_of_rollouts_in_pieces_alone_times_out_and_takes_them(tmp_path: Path) -> None:
    """A first piece opens its group, so the group timeout reaches a rollout whose worker vanished."""
    clock = Clock()
    with Store(tmp_path / "data", map_size=1 << 24, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, group_timeout_seconds=5))
        first = trxp.from_experience(split(rollout(), [4, 8])[0])
        assert store.put("t", [first]).partial == [first.uid]
        assert store.stats("t")["partials"] == 1 and store.stats("t")["groups_pending"] == 1
        clock.now += 6
        assert store.tick()["groups_timed_out"] == 1
        stats = store.stats("t")
        assert (stats["partials"], stats["groups_pending"], stats["dropped_short"]) == (0, 0, 1)
        assert store.get_partials("t", ["0/0"]) == (trxp.build([]), [])


def test_a_format_7_directory_upgrades_and_holds_pieces(tmp_path: Path) -> None:
    """A directory of the format before partial rollouts (no partials database) opens at today's format,
    the database created in the open's transaction, and takes pieces."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        env = store.environment.env
        with env.begin(write=True) as txn:
            txn.put(b"format", b"7", db=store.environment.db["meta"])
            txn.drop(env.open_db(b"partials", txn=txn), delete=True)
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.environment.db["meta"]) == str(layout.FORMAT).encode()
        first = trxp.from_experience(split(rollout(), [4, 8])[0])
        assert store.put("t", [first]).partial == [first.uid]


def test_a_multimodal_rollout_in_pieces_keeps_its_images_and_an_empty_first_piece_is_refused(
    client: BufferClient,
) -> None:
    client.create_table("mm", group_size=1, estimator="none")
    whole = rollout()
    whole.multi_modal_inputs = {"pixel_values": torch.rand(2, 3, 4)}
    first, second, last = split(whole, [4, 8])
    assert client.push([first], table="mm").partial == [whole.eid.uid]
    assert client.push([second], table="mm").partial == [whole.eid.uid]
    (held,) = client.get_partials(["0/0"], table="mm")
    assert torch.equal(held.multi_modal_inputs["pixel_values"], whole.multi_modal_inputs["pixel_values"])
    assert client.push([last], table="mm").stored == [whole.eid.uid]
    (got,) = client.get([whole.eid.uid], table="mm")
    same(got, whole)
    assert torch.equal(got.multi_modal_inputs["pixel_values"], whole.multi_modal_inputs["pixel_values"])
    empty = Experience(eid=EID(batch=0, task=1, run=0), tokens=torch.zeros(0, dtype=torch.int32), prompt_length=0)
    empty.info["partial"] = True
    with pytest.raises(InvalidArgumentError, match="this one has no tokens"):
        client.push([empty], table="mm")


def test_a_sealed_group_drops_its_runs_in_pieces(tmp_path: Path) -> None:
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=3))
        first = trxp.from_experience(split(rollout(run=2), [4, 8])[0])
        store.put("t", [trxp.from_experience(rollout(run=0)), first])
        assert store.seal("t", "0/0") == 1
        assert store.stats("t")["partials"] == 0 and store.get_partials("t", ["0/0"]) == (trxp.build([]), [])
        with pytest.raises(GroupClosed, match="already complete"):  # not: the buffer holds 0 of its tokens
            store.put("t", [trxp.from_experience(split(rollout(run=2), [4, 8])[1])])


@pytest.mark.parametrize("storage", ["rows", "records"])
def test_a_rollout_in_pieces_dropped_as_stale_leaves_no_empty_group(tmp_path: Path, storage: str) -> None:
    """A rollout's first piece opens its group; its last, stale (the trainer moved on, on_stale =
    drop), is dropped as a stale push is. The group stayed pending with nothing in it, counted and
    holding its places in the table's capacity: two such groups made an empty table of four places
    refuse every push, for good without a group timeout (a helper's audit). A group left with nothing
    goes, as if the pieces had never opened it; one that holds another run stays."""
    config = TableConfig.of(
        "t", estimator="none", group_size=2, layout=storage, max_staleness=1, on_stale="drop",
        capacity_experiences=4, when_full="block",
    )  # fmt: skip
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(config)
        store.set_trainer_version("t", 5)
        for task in range(3):
            old = rollout(task=task)
            old.info["model_version"], old.info["version_segments"] = 3, [[3, 0]]
            first, last = split(old, [4])
            assert store.put("t", [trxp.from_experience(first)]).partial == [first.eid.uid]
            assert store.put("t", [trxp.from_experience(last)]).stale == [last.eid.uid]
            stats = store.stats("t")
            assert (stats["groups_pending"], stats["pending"], stats["partials"]) == (0, 0, 0), stats
        kept = rollout(task=9, run=1)
        kept.info["model_version"], kept.info["version_segments"] = 5, [[5, 0]]
        old = rollout(task=9)
        old.info["model_version"], old.info["version_segments"] = 3, [[3, 0]]
        first, last = split(old, [4])
        store.put("t", [trxp.from_experience(kept), trxp.from_experience(first)])
        assert store.put("t", [trxp.from_experience(last)]).stale == [last.eid.uid]
        assert (store.stats("t")["groups_pending"], store.stats("t")["pending"]) == (1, 1)
        fresh = [rollout(task=7, run=run) for run in (0, 1)]
        for exp in fresh:
            exp.info["model_version"], exp.info["version_segments"] = 5, [[5, 0]]
        assert store.put("t", [trxp.from_experience(exp) for exp in fresh]).completed_groups == ["0/7"]
        assert store.verify("t") == []


@pytest.mark.parametrize("storage", ["rows", "records"])
def test_a_deleted_group_takes_its_runs_in_pieces(tmp_path: Path, storage: str) -> None:
    """A pending group deleted (by its id, or with its last member) leaves the table, and its runs
    in pieces with it: they stayed, counted against the capacity, with no group left to time out.
    A group of runs in pieces alone, no member stored yet, goes when its id is named too."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=3, layout=storage))
        for task in (0, 1):
            first = trxp.from_experience(split(rollout(task=task, run=2), [4, 8])[0])
            store.put("t", [trxp.from_experience(rollout(task=task, run=0)), first])
        only = trxp.from_experience(split(rollout(task=2, run=1), [4, 8])[0])  # a group of pieces alone
        store.put("t", [only])
        assert store.delete("t", group_ids=["0/0"]) == 1
        assert store.delete("t", uids=["0/1/0/0/r"]) == 1
        assert store.delete("t", group_ids=["0/2"]) == 0  # no experience in it, but it goes all the same
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"], stats["groups_pending"]) == (0, 0, 0)
        assert store.get_partials("t", ["0/0", "0/1", "0/2"]) == (trxp.build([]), [])
        assert store.verify("t") == []
        assert store.put("t", [only]).partial == [only.uid]  # its key and uid may be pushed again
        assert (store.stats("t")["partials"], store.stats("t")["groups_pending"]) == (1, 1)


@pytest.mark.parametrize("storage", ["rows", "records"])
def test_a_delete_of_a_group_takes_its_runs_in_pieces_in_a_table_whose_groups_do_not_wait(
    tmp_path: Path, storage: str
) -> None:
    """With group_size 0 a Delete of a group left its runs in pieces held, counted in expbuf_partials
    and against capacity_bytes, with no timeout, seal or report of a failed run to reach them. A
    Delete naming a group takes them, whether the group holds experiences (its runs held in pieces
    before it completed went then) or none yet; another task's stay."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=0, layout=storage))
        for task in (0, 1, 2):
            store.put("t", [trxp.from_experience(split(rollout(task=task, run=1), [4, 8])[0])])
        kept = store.stats("t")["partial_bytes"] // 3
        store.put("t", [trxp.from_experience(rollout(task=0, run=0))])  # completes 0/0, dropping its run 1
        assert (store.stats("t")["partials"], store.stats("t")["partial_bytes"]) == (2, 2 * kept)
        assert store.delete("t", group_ids=["0/0", "0/1"]) == 1
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"]) == (1, kept)
        assert store.get_partials("t", ["0/0", "0/1"]) == (trxp.build([]), [])
        assert store.verify("t") == []


@pytest.mark.usefixtures("table_layout")
@pytest.mark.parametrize("group_size", [0, 3])
def test_a_delete_of_a_uid_held_in_pieces_takes_its_pieces(start_server: Servers, group_size: int) -> None:
    """Delete by the uid of a rollout held in pieces deleted nothing: its pieces stayed, counted in
    expbuf_partials and against capacity_bytes. They go, counted as a Delete of their group counts
    them (no experience removed); another run's pieces and experiences stay (with group_size 0, the
    push that completed their group took its runs in pieces). A group that held nothing else goes
    with them, as one named bare by a Delete does."""
    server = start_server()
    alone, held, whole = rollout(task=1, run=0), rollout(run=1), rollout(run=0)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=group_size, estimator="none")
        client.push([split(held, [4, 8])[0], split(rollout(run=2), [4, 8])[0]], table="t")
        one = server.store.stats("t")["partial_bytes"] // 2
        client.push([whole], table="t")  # with group_size 0 it completes the group, its runs in pieces dropped
        client.push([split(alone, [4, 8])[0]], table="t")
        assert client.delete([held.eid.uid, alone.eid.uid], table="t") == 0
        left = ["0/0/2/0/r"] if group_size else []
        assert [exp.eid.uid for exp in client.get_partials(["0/0", "0/1"], table="t")] == left
        assert scrape(server.metrics_port)[("expbuf_partials", (("table", "t"),))] == len(left)
        assert server.store.stats("t")["partial_bytes"] == one * len(left)
        stats = client.stats("t")["t"]
        assert (stats.live, stats.groups_pending) == (1, 1 if group_size else 0)
        if group_size:  # pushed again
            assert client.push([split(held, [4, 8])[0]], table="t").partial == [held.eid.uid]
        else:  # a piece of a run of a complete group: it could never join it
            with pytest.raises(FailedPreconditionError, match="already complete"):
                client.push([split(held, [4, 8])[0]], table="t")
    assert server.store.verify("t") == []


@pytest.mark.parametrize("storage", ["rows", "records"])
def test_pieces_sent_again_after_their_rollout_are_counted_as_duplicates(tmp_path: Path, storage: str) -> None:
    """A worker that sends its pieces again (a retry after a lost reply) once the rollout they made
    is stored hears each is a duplicate, and the table counts them as it counts a whole one's
    (Stats.duplicates, expbuf_duplicates_total): it counted the whole one's alone (a helper's audit)."""
    whole = rollout(run=1)
    pieces = [trxp.from_experience(piece) for piece in split(whole, [4, 8])]
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=3, layout=storage))
        for piece in pieces:
            store.put("t", [piece])
        answered = sum(len(store.put("t", [piece]).duplicates) for piece in pieces)
        answered += len(store.put("t", [trxp.from_experience(whole)]).duplicates)
        assert answered == 4 and store.stats("t")["duplicates"] == 4


@pytest.mark.parametrize("group_size", [0, 3])
def test_a_rollout_pushed_whole_replaces_its_pieces(tmp_path: Path, group_size: int) -> None:
    """A rollout pushed whole in a push of no piece left its pieces held (only a push with a piece in
    it replaced them), counted against capacity_bytes; with group_size 0 nothing else would take
    them. They go as the rollout is stored."""
    whole = rollout(run=1)
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=group_size))
        store.put("t", [trxp.from_experience(split(whole, [4, 8])[0])])
        assert store.put("t", [trxp.from_experience(whole)]).stored == [whole.eid.uid]
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"]) == (0, 0)
        same(read_back(store, "t", whole.eid.uid), whole)
        assert store.verify("t") == []


@pytest.mark.parametrize("storage", ["rows", "records"])
@pytest.mark.parametrize("how", ["after", "in its push", "computing"])
def test_a_group_complete_with_all_its_runs_drops_the_runs_in_pieces_that_did_not_join(
    tmp_path: Path, storage: str, how: str
) -> None:
    """A group of 2 that completed with two runs pushed whole kept a third run's pieces held: no
    piece of it could be pushed any more (GroupClosed), nor the run whole, yet they stayed counted
    against capacity_bytes while the group lived (for good in a table that replays its groups), and
    the check said nothing. A group's completion drops them, as a sealed or timed out one's does;
    a push that completes it and carries such a piece is refused, nothing of it stored."""
    estimator = "grpo" if how == "computing" else "none"
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator=estimator, group_size=2, layout=storage))
        stray = trxp.from_experience(split(rollout(run=5), [4, 8])[0])
        runs = [trxp.from_experience(rollout(run=run, reward=float(run))) for run in (0, 1)]
        if how == "in its push":  # the piece would be answered stored and dropped in one commit
            with pytest.raises(GroupOverfilled, match="could then never join it"):
                store.put("t", [stray, *runs])
            assert (store.stats("t")["pushed"], store.stats("t")["partials"]) == (0, 0)
        else:
            assert store.put("t", [stray]).partial == [stray.uid]
        assert store.put("t", runs).completed_groups == ["0/0"]
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"]) == (0, 0)
        assert stats["computing" if how == "computing" else "ready"] == 2
        assert store.get_partials("t", ["0/0"]) == (trxp.build([]), [])
        assert store.verify("t") == []


@pytest.mark.parametrize("storage", ["rows", "records"])
@pytest.mark.parametrize("estimator", ["none", "grpo"])
def test_a_group_complete_with_its_push_drops_the_runs_in_pieces_held_before_it(
    tmp_path: Path, storage: str, estimator: str
) -> None:
    """With group_size 0, runs of a task held in pieces before any of its runs was pushed whole stayed
    held once a push completed the task's group without them: no piece of them could be pushed any
    more (GroupClosed), nor their last, yet they stayed counted in expbuf_partials and against
    capacity_bytes until a Delete named them or their group. The group's completion drops them, as a
    group of group_size runs drops its runs in pieces; another task's run in pieces stays, and a
    later piece of a run dropped is refused GroupClosed, nothing of it stored."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator=estimator, group_size=0, layout=storage))
        elsewhere = trxp.from_experience(split(rollout(task=1, run=5), [4, 8])[0])
        assert store.put("t", [elsewhere]).partial == [elsewhere.uid]
        kept = store.stats("t")["partial_bytes"]
        strays = [split(rollout(run=run), [4, 8]) for run in (5, 6)]
        assert store.put("t", [trxp.from_experience(pieces[0]) for pieces in strays]).partial == [
            "0/0/5/0/r", "0/0/6/0/r",
        ]  # fmt: skip
        runs = [trxp.from_experience(rollout(run=run, reward=float(run))) for run in (0, 1)]
        assert store.put("t", runs).completed_groups == ["0/0"]
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"]) == (1, kept)
        assert stats["computing" if estimator == "grpo" else "ready"] == 2
        assert store.get_partials("t", ["0/0"]) == (trxp.build([]), [])
        assert store.get_partials("t", ["0/1"]) != (trxp.build([]), [])
        with pytest.raises(GroupClosed, match="already complete"):
            store.put("t", [trxp.from_experience(strays[0][1])])
        assert (store.stats("t")["partials"], store.stats("t")["partial_bytes"]) == (1, kept)
        assert store.verify("t") == []


@pytest.mark.parametrize("group_size", [2, 0])
def test_the_check_names_runs_in_pieces_whose_group_is_complete(tmp_path: Path, group_size: int) -> None:
    """Pieces whose group is complete (as a group complete with all its runs left them, or with
    group_size 0 one completed by a push after them) can never join it: verify() and `expbuf check`
    passed over them. They are named, as what nothing reads (a full check at a start leaves them, as
    it does stray chunk sets); pieces of a group not stored (a prompt's next attempt, handed the
    pieces of the last) are not. A Delete of the group takes them."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=group_size))
        store.put("t", [trxp.from_experience(rollout(run=run)) for run in (0, 1)])
        for task in (1, 2):
            store.put("t", [trxp.from_experience(split(rollout(task=task, run=5), [4, 8])[0])])
        prefix = layout.table_prefix(store.catalog.lookup("t")[0])
        db = store.db["partials"]

        def moved(txn: lmdb.Transaction) -> None:  # task 1's pieces under task 0's group, task 2's under task 3
            for old, new in ((b"0/1/", b"0/0/"), (b"0/2/", b"0/3/")):
                for number in (None, 0):
                    key = prefix + old + b"5/0/r\0" + (b"" if number is None else number.to_bytes(4, "big"))
                    value = txn.get(key, db=db)
                    txn.delete(key, db=db)
                    txn.put(key.replace(old, new, 1), value, db=db)

        store.environment.submit(moved)
        (problem,) = store.verify("t")
        assert problem.startswith("partial rollout 0/0/5/0/r: its group 0/0 is complete (ready), so its pieces never")
    with Store(tmp_path / "data", map_size=1 << 24, check_at_open="full") as store:
        assert store.delete("t", group_ids=["0/0"]) == 2 and store.verify("t") == []


HELD = "0/0/1/0/r"  # the rollout of two pieces the check's tests damage


def held_in_pieces(store: Store) -> tuple[bytes, int, int]:
    """Table t holding two rollouts in pieces (another in one piece, then HELD in two): the key of
    HELD's head in the partials database, the other's bytes and the bytes of both."""
    store.create_table(TableConfig.of("t", estimator="none", group_size=3))
    store.put("t", [trxp.from_experience(split(rollout(run=2), [4, 8])[0])])
    other = store.stats("t")["partial_bytes"]
    first, second, _ = split(rollout(run=1), [4, 8])
    store.put("t", [trxp.from_experience(first)])
    store.put("t", [trxp.from_experience(second)])
    assert store.verify("t") == []
    prefix = layout.table_prefix(store.catalog.lookup("t")[0])
    return prefix + HELD.encode() + b"\0", other, store.stats("t")["partial_bytes"]


def piece_key(head: bytes, number: int) -> bytes:
    return head + number.to_bytes(4, "big")


@pytest.mark.parametrize(
    "damage",
    ["piece lost", "piece damaged", "head lost", "head damaged", "piece past its head", "counters", "a stray key"],
)
def test_the_check_reads_the_rollouts_held_in_pieces(tmp_path: Path, damage: str) -> None:
    """verify() (and so `expbuf check` and a full check at open) reads each rollout held in pieces as
    it reads a pending group's head and fragments: each piece its head names stored and the one
    pushed, no piece its head does not name, the counters of them right; each named in its words."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        head, other, total = held_in_pieces(store)
        db = store.db["partials"]

        def hurt(txn: lmdb.Transaction) -> None:
            if damage == "piece lost":
                txn.delete(piece_key(head, 1), db=db)
            elif damage == "piece damaged":
                blob = bytearray(txn.get(piece_key(head, 0), db=db))
                blob[-1] ^= 0xFF
                txn.put(piece_key(head, 0), bytes(blob), db=db)
            elif damage == "head lost":
                txn.delete(head, db=db)
            elif damage == "head damaged":
                txn.put(head, txn.get(head, db=db)[:-3], db=db)  # cut short
            elif damage == "piece past its head":
                txn.put(piece_key(head, 5), b"x", db=db)
            elif damage == "a stray key":
                txn.put(head[:4] + b"0/0/\xff", b"x", db=db)
            else:
                counters = read_counters(txn, store.db, head[:4])
                counters.partials, counters.partial_bytes = 5, 7
                write_counters(txn, store.db, head[:4], counters)

        store.environment.submit(hurt)
        problems = store.verify("t")
        if damage == "head damaged":
            (problem,) = problems
            assert problem.startswith(f"the head of partial rollout {HELD} does not decode ("), problem
            return
        counters = "counters partials and partial_bytes are"
        want = {
            "piece lost": [f"partial rollout {HELD}: its piece 1 is not stored"],
            "piece damaged": [f"partial rollout {HELD}, piece 0: its payload does not match its digest"],
            "head lost": [
                f"partial rollout {HELD}: 2 piece(s) are stored but not its head",
                f"{counters} 2 and {total} but 1 rollout(s) of {other} bytes were found",
            ],
            "piece past its head": [f"partial rollout {HELD}: its piece 5 is stored, but its head names 2"],
            "a stray key": ["a row of the partials database is neither a rollout's head nor a piece"],
            "counters": [f"{counters} 5 and 7 but 2 rollout(s) of {total} bytes were found"],
        }
        assert problems == want[damage]


def test_expbuf_check_and_a_full_open_name_a_damaged_piece(tmp_path: Path) -> None:
    """A piece damaged on disk is damage as an experience's payload is: `expbuf check` names it (exit
    1) and a start that checks everything refuses the directory naming it; a quick start serves it,
    and with the piece put back the check finds nothing."""
    data = tmp_path / "data"
    with Store(data, map_size=1 << 24) as store:
        head, _, _ = held_in_pieces(store)
        db = store.db["partials"]
        blob = store.environment.submit(lambda txn: bytes(txn.get(piece_key(head, 1), db=db)))
        store.environment.submit(lambda txn: txn.put(piece_key(head, 1), blob[:-1], db=db))
    command = [sys.executable, "-m", "expbuf.server.cli", "check", "--data", str(data)]
    checked = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    said = f"partial rollout {HELD}, piece 1: its payload is {len(blob) - 1} bytes, its record says {len(blob)}"
    lines = checked.stdout.splitlines()
    assert checked.returncode == 1 and lines == ["default: ok", "t: 1 problem(s)", f"  {said}"], checked
    with pytest.raises(Damaged, match=re.escape(f"table t: {said}")):
        Store(data, map_size=1 << 24, check_at_open="full")
    with Store(data, map_size=1 << 24) as store:
        store.environment.submit(lambda txn: txn.put(piece_key(head, 1), blob, db=store.db["partials"]))
    checked = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 0 and checked.stdout.splitlines() == ["default: ok", "t: ok"], checked


def hurt_piece(store: Store, table: str, uid: str, number: int, how: str = "flipped") -> None:
    """Damage piece `number` of the uid's rollout held in pieces, in LMDB: its last byte flipped (its
    size unchanged, in its last tensor's data), or the piece lost."""
    key = piece_key(layout.table_prefix(store.catalog.lookup(table)[0]) + uid.encode() + b"\0", number)
    db = store.db["partials"]

    def hurt(txn: lmdb.Transaction) -> None:
        if how == "lost":
            assert txn.delete(key, db=db)
            return
        blob = bytearray(txn.get(key, db=db))
        blob[-1] ^= 0xFF
        txn.put(key, bytes(blob), db=db)

    store.environment.submit(hurt)


@pytest.mark.parametrize("how", ["flipped", "lost"])
@pytest.mark.parametrize("where", ["in the writer", "off the writer"])
def test_a_last_piece_over_a_damaged_piece_stores_nothing_and_the_rollout_starts_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str, how: str
) -> None:
    """A piece damaged on disk was put together into its rollout by the last piece's push and stored
    under a fresh digest (no check met it again); a lost one was refused INTERNAL, or, in a rollout
    put together off the writer, Conflict after every try. Each piece is checked against the size and
    digest its head took at its push: the last piece is refused DamagedPiece (DATA_LOSS) naming the
    rollout and the piece, nothing of it stored, the rollout's pieces dropped and counted as damage
    found, so that its worker pushes it again from its first piece, which stores it whole."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    large = where == "off the writer"
    whole = long_rollout(run=1) if large else rollout(run=1)
    cuts = [3000, 6000, 8191] if large else [4, 8]
    pieces = [trxp.from_experience(p) for p in split(whole, cuts)]
    uid = whole.eid.uid
    with Store(tmp_path / "data", map_size=1 << 28) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=1))
        for piece in pieces[:-1]:
            assert store.put("t", [piece]).partial == [uid]
        hurt_piece(store, "t", uid, 1, how)
        why = "it is not stored" if how == "lost" else "its payload does not match its digest"
        with pytest.raises(DamagedPiece, match=re.escape(f"partial rollout {uid}, piece 1: {why}")) as refused:
            store.put("t", pieces[-1:])
        assert refused.value.status == "DATA_LOSS"
        assert "push the rollout again from its first piece" in str(refused.value)
        stats = store.stats("t")
        assert (stats["pushed"], stats["ready"], stats["partials"], stats["partial_bytes"]) == (0, 0, 0, 0)
        assert stats["damaged"] == 1 and stats["last_failure"].startswith(f"partial rollout {uid}, piece 1: {why}")
        assert store.get("t", [uid]) == {}
        assert any(uid in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
        with store.environment.read() as txn:
            assert chunked.staged_sets(txn, store.environment.db) == 0
        assert store.verify("t") == []
        for piece in pieces[:-1]:  # the worker starts the rollout over
            assert store.put("t", [piece]).partial == [uid]
        assert store.put("t", pieces[-1:]).stored == [uid]
        same(read_back(store, "t", uid), whole)
        assert store.verify("t") == []


def pushed_again_whole(
    server: ExpbufServer, client: BufferClient, whole: Experience, pieces: list[Experience], partner: Experience
) -> Experience:
    """After `whole`, a rollout in pieces of group 0/0 of table t (`partner` its group's other run),
    was refused as damaged: nothing of it is held or counted, the server still serves, and its
    worker's `pieces` pushed again from the first complete the group; the rollout as read back."""
    assert client.get_partials(["0/0"], table="t") == []
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_damaged_total", (("table", "t"),))] == 1
    assert metrics[("expbuf_partials", (("table", "t"),))] == 0
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    for piece in pieces[:-1]:
        assert client.push([piece], table="t").partial == [whole.eid.uid]
    done = client.push([pieces[-1], partner], table="t")
    assert (done.stored, done.completed_groups) == ([whole.eid.uid, partner.eid.uid], ["0/0"])
    (got,) = client.get([whole.eid.uid], table="t")
    return got


def test_a_damaged_piece_refuses_its_push_data_loss_and_leaves_the_server_healthy(start_server: Servers) -> None:
    """Through the server: the push of a last piece over a damaged piece is refused DATA_LOSS (reason
    damaged) naming the rollout and the piece, nothing of the push stored (not its partner either),
    the damage in Stats and expbuf_damaged_total; the health check says SERVING, and the rollout
    pushed again from its first piece is stored with its group."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    whole, partner = rollout(run=1), rollout(run=0, reward=0.0)
    pieces = split(whole, [4, 8])
    with BufferClient(target, timeout=20) as client:
        client.create_table("t", group_size=2, estimator="none")
        for piece in pieces[:-1]:
            assert client.push([piece], table="t").partial == [whole.eid.uid]
        hurt_piece(server.store, "t", whole.eid.uid, 0)
        with pytest.raises(DataLossError, match=re.escape(f"partial rollout {whole.eid.uid}, piece 0: ")) as refused:
            client.push([pieces[-1], partner], table="t")
        assert refused.value.reason == "damaged"
        stats = client.stats("t")["t"]
        assert (stats.pushed, stats.pending, stats.damaged) == (0, 0, 1)
        assert stats.last_failure.startswith(f"partial rollout {whole.eid.uid}, piece 0")
        got = pushed_again_whole(server, client, whole, pieces, partner)
    same(got, whole)
    assert server.store.verify("t") == []


def test_get_partials_leaves_out_a_rollout_with_a_damaged_piece_and_drops_it(start_server: Servers) -> None:
    """get_partials served a rollout put together with a damaged piece, which its worker then
    continued. The rollout is left out of the reply (the others of its task are served), its pieces
    dropped and counted as damage found, so its worker, finding nothing held, starts it over."""
    server = start_server()
    damaged, intact = rollout(run=1), rollout(run=2)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=3, estimator="none")
        for whole in (damaged, intact):
            client.push(split(whole, [4, 8])[:2], table="t")
        hurt_piece(server.store, "t", damaged.eid.uid, 1)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # the unary call, by uid
            request = pb.GetPartialsRequest(table="t", uids=[damaged.eid.uid, intact.eid.uid])
            reply = pb_grpc.ExperienceBufferStub(channel).GetPartials(request, timeout=20)
        assert [exp.eid.uid for exp in trxp.decode(reply.payload)] == [intact.eid.uid]
        (held,) = client.get_partials(["0/0"], table="t")
        assert held.eid.uid == intact.eid.uid and held.tokens.numel() == PROMPT + 8
        stats = client.stats("t")["t"]
        assert stats.damaged == 1 and stats.last_failure.startswith(f"partial rollout {damaged.eid.uid}, piece 1")
        first = split(damaged, [4, 8])[0]
        assert client.push([first], table="t").partial == [damaged.eid.uid]  # started over
    assert server.store.verify("t") == []


def test_rollouts_a_reply_cannot_hold_come_in_more_replies(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("big", group_size=4, estimator="none")
        for run in range(3):
            whole = rollout(run=run)
            whole.multi_modal_inputs = {"pixel_values": torch.rand(100, 200)}  # 80 KB each
            client.push([split(whole, [4, 8])[0]], table="big")
    with BufferClient(target, max_message_bytes=200_000, push_chunk_bytes=0) as small:  # one rollout a reply
        held = small.get_partials(["0/0"], table="big")
    assert sorted(exp.eid.run for exp in held) == [0, 1, 2]


def test_pieces_count_against_capacity_bytes(client: BufferClient) -> None:
    """A worker whose rollouts never finish cannot fill the disk: the pieces held count in the
    table's capacity_bytes. In a blocking table a piece past it waits for room (nothing of it
    stored) until pieces go; an evicting one evicts its oldest ready group for it."""
    client.create_table("block", group_size=2, estimator="none", capacity_bytes=16_000)
    held: list[Experience] = []
    with pytest.raises((DeadlineExceededError, ResourceExhaustedError)):  # the wait ends either side of the wire
        for run in range(200):
            first, _ = split(rollout(task=run, run=0), [4])
            client.push([first], table="block", timeout=1.0)  # a full table: it waits for room, then gives up
            held.append(first)
    assert 0 < len(held) < 200
    assert len(client.get_partials([f"0/{run}" for run in range(len(held) + 1)], table="block")) == len(held)
    client.fail_runs([p.eid.uid for p in held[:2]], table="block")  # their pieces go: room again
    more, _ = split(rollout(task=500, run=0), [4])
    assert client.push([more], table="block").partial == [more.eid.uid]

    client.create_table("evict", group_size=1, estimator="none", capacity_bytes=16_000, when_full="evict")
    client.push([rollout(task="whole", run=0)], table="evict")  # a ready group
    for run in range(len(held)):  # as many pieces as fill the table: the whole rollout makes room for them
        first, _ = split(rollout(task=run, run=0), [4])
        assert client.push([first], table="evict").partial == [first.eid.uid]
        if client.stats("evict")["evict"].evicted:
            break
    assert client.stats("evict")["evict"].evicted == 1


def test_a_rollout_larger_than_a_message_comes_whole_in_parts(start_server: Servers) -> None:
    """A long agentic rollout held in pieces may outgrow one message: get_partials reads it in parts
    (ReadPartials), whole, from the blocking and asyncio clients, and with a receive limit of the
    client's own smaller than the server's; the unary GetPartials an older client calls refuses it
    by name, as before."""
    server = start_server(max_message_bytes=4 << 20)
    target = f"127.0.0.1:{server.port}"
    whole = rollout(run=0)
    whole.multi_modal_inputs = {"pixel_values": torch.rand(1500, 1000)}  # 6 MB: more than a message
    first, _ = split(whole, [4])
    small = rollout(run=1)
    with BufferClient(target, timeout=120, push_chunk_bytes=1 << 20) as client:
        client.create_table("t", group_size=2, estimator="none")
        assert client.push([first, split(small, [4])[0]], table="t").partial == [first.eid.uid, small.eid.uid]
        held = client.get_partials(["0/0"], table="t")

    async def read() -> list[Experience]:
        async with AsyncBufferClient(target, timeout=120) as aio:
            return await aio.get_partials(["0/0"], table="t")

    with BufferClient(target, timeout=120, max_message_bytes=1 << 20, push_chunk_bytes=0) as narrow:
        narrowed = narrow.get_partials(["0/0"], table="t")
    for got in (held, asyncio.run(read()), narrowed):
        assert sorted(exp.eid.uid for exp in got) == sorted([first.eid.uid, small.eid.uid])
        big = next(exp for exp in got if exp.eid.uid == first.eid.uid)
        assert torch.equal(big.multi_modal_inputs["pixel_values"], whole.multi_modal_inputs["pixel_values"])
        assert torch.equal(big.tokens, whole.tokens[: PROMPT + 4]) and big.info["partial"] is True
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ExperienceBufferStub(channel).GetPartials(
            pb.GetPartialsRequest(table="t", uids=[first.eid.uid]), timeout=60
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"rollout {first.eid.uid} held in pieces takes more than a reply" in (refused.value.details() or "")
    with grpc.insecure_channel(target) as channel:  # a ReadPartials that takes no parts is refused so too
        request = pb.GetPartialsRequest(table="t", uids=[first.eid.uid])
        with pytest.raises(grpc.RpcError) as whole:
            list(channel.unary_stream("/expbuf.v1.ExperienceBuffer/ReadPartials")(request.SerializeToString()))
    assert whole.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "a client that takes replies in parts" in (whole.value.details() or "")


class OlderServer(pb_grpc.ExperienceBufferServicer):
    """A server of a release before ReadPartials: the unary GetPartials alone answers."""

    def __init__(self, experiences: list[Experience]) -> None:
        self.payload = trxp.encode(experiences)
        self.asked: list[list[str]] = []

    def GetPartials(self, request: pb.GetPartialsRequest, context: object) -> pb.GetReply:
        self.asked.append(list(request.task_ids))
        return pb.GetReply(payload=self.payload)


def test_get_partials_of_a_server_without_read_partials_falls_back_to_the_unary_call() -> None:
    piece, _ = split(rollout(run=0), [4])
    older = OlderServer([piece])
    with serving(older) as target, BufferClient(target, timeout=10) as client:
        (got,) = client.get_partials(["0/0"], table="t")
    assert torch.equal(got.tokens, piece.tokens) and older.asked == [["0/0"]]


def test_with_tokens_a_prompts_pieces_are_its_claimants_to_read_and_to_push_again(start_server: Servers) -> None:
    """Issue 63: GetPartials and ReadPartials served any task's pieces to any push token, under
    another token's claim too, and a push of a piece answered its duplicate and offset checks
    before the claim's: another token got OK for a copy, and an ALREADY_EXISTS naming the
    claimant's progress. With tokens on, a prompt's pieces are read by its claimant alone (after a
    claim ends, by the next attempt's), and a piece from another token is refused before it is
    compared with what the buffer holds, a copy of a finished rollout's too."""
    scopes = frozenset({"push", "sample", "admin"})
    server = start_server(tokens={"a": scopes, "b": scopes})
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="a", timeout=20) as a, BufferClient(target, token="b", timeout=20) as b:
        a.create_table("t", group_size=2, estimator="none")
        a.create_dataset("t", "d", 2)
        (prompt,) = a.claim("t", "d", 1, lease_seconds=60).prompts
        tid = f"{prompt.batch}/{prompt.task}"
        first, second, last = split(rollout(prompt.task, 0, prompt.batch), [4, 8])
        assert a.push([first], table="t").partial == [first.eid.uid]
        with pytest.raises(PermissionDeniedError, match=rf"task {tid} .*claimed with another token"):
            b.get_partials([tid], table="t")
        metadata = (("authorization", "Bearer b"),)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.ExperienceBufferStub(channel)
            for request in (
                pb.GetPartialsRequest(table="t", task_ids=[tid]),
                pb.GetPartialsRequest(table="t", uids=[first.eid.uid]),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.GetPartials(request, metadata=metadata, timeout=20)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            b.push([first], table="t")  # a copy: no longer answered as a duplicate
        with pytest.raises(PermissionDeniedError, match="claimed with another token") as ahead:
            b.push([last], table="t")  # at an offset the buffer does not hold
        assert "holds" not in str(ahead.value)  # nothing of the claimant's progress
        (held,) = a.get_partials([tid], table="t")
        assert held.tokens.numel() == PROMPT + 4
        assert a.push([second], table="t").partial == [second.eid.uid]
        done = a.push([last, rollout(prompt.task, 1, prompt.batch, reward=0.0)], table="t")
        assert done.completed_groups == [tid]
        assert a.push([last], table="t").duplicates == [last.eid.uid]  # its claimant's retry: a duplicate
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            b.push([last], table="t")  # another token's copy of the finished rollout
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            b.push([rollout(prompt.task, 1, prompt.batch, reward=0.0)], table="t")  # a copy pushed whole

        (other,) = a.claim("t", "d", 1, lease_seconds=60).prompts  # a claim that ends: its pieces carried
        piece, _ = split(rollout(other.task, 0, other.batch), [4])
        assert a.push([piece], table="t").partial == [piece.eid.uid]
        assert a.release_claims([other]) == 1
        nxt = f"{other.batch}/{other.index}@1"
        for reader in (a, b):  # no claim holds the next attempt: no one reads them
            with pytest.raises(PermissionDeniedError, match="which no claim holds"):
                reader.get_partials([nxt], table="t")
        (again,) = b.claim("t", "d", 1, lease_seconds=60).prompts
        assert (again.index, again.attempt) == (other.index, 1)
        (carried,) = b.get_partials([nxt], table="t")  # the next attempt's claimant
        assert carried.tokens.numel() == PROMPT + 4
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            a.get_partials([nxt], table="t")


def test_without_tokens_any_caller_reads_any_tasks_pieces(client: BufferClient) -> None:
    client.create_table("t", group_size=2, estimator="none")
    client.create_dataset("t", "d", 1)
    (prompt,) = client.claim("t", "d", 1, lease_seconds=60).prompts
    first, _ = split(rollout(prompt.task, 0, prompt.batch), [4])
    client.push([first], table="t")
    assert client.release_claims([prompt]) == 1  # carried to attempt 1, which no claim holds yet
    (held,) = client.get_partials([f"{prompt.batch}/{prompt.index}@1"], table="t")
    assert held.tokens.numel() == PROMPT + 4


WIDE = 1024  # routing ids a token: a rollout of 8,192 tokens takes about 8 MiB


def long_rollout(task: int | str = 0, run: int = 0, response: int = 8192, batch: int | str = 0) -> Experience:
    """A long agentic rollout with wide routing data: larger than a chunk (chunk_heads.CHUNK_BYTES)."""
    length = PROMPT + response
    generator = torch.Generator().manual_seed(run)
    mask = torch.ones(response, dtype=torch.bool)
    mask[::7] = False
    return Experience(
        eid=EID(batch=batch, task=task, run=run, suffix="r"),
        tokens=torch.randint(0, 50_000, (length,), dtype=torch.int32, generator=generator),
        prompt_length=PROMPT,
        logprobs=-torch.rand(response, generator=generator),
        action_mask=mask,
        routed_experts=torch.randint(0, 255, (length, WIDE), dtype=torch.uint8, generator=generator),
        reward=float(run),
        info={"model_version": 3, "version_segments": [[3, 0], [4, 4000]]},
    )


def read_back(store: Store, table: str, uid: str) -> Experience:
    (got,) = trxp.decode(store.get(table, [uid])[uid])
    return got


@pytest.mark.parametrize("how", ["each alone", "in one push", "in one stream", "compressed"])
def test_a_large_rollout_is_put_together_off_the_writer_as_a_staged_chunk_set(tmp_path: Path, how: str) -> None:
    """Issue 63: the last piece put the whole rollout together in the writer (every piece copied and
    parsed, merged, packed, parsed again, in the push's transaction). A rollout larger than a
    chunk is read from snapshots into a staged chunk set off the writer, a chunk at a time
    (Pushing.stage), and stored as the experience pushed whole: equal field by field, its generated
    tokens counted, its check clean, no staged set left."""
    whole = long_rollout()
    pieces = [trxp.from_experience(p) for p in split(whole, [3000, 6000, 8191])]  # the last: one token
    staged: list[int] = []
    with Store(tmp_path / "data", map_size=1 << 28) as store:
        settings = {"compression": "zstd"} if how == "compressed" else {}
        store.create_table(TableConfig.of("t", estimator="none", group_size=1, **settings))
        stage = store.pushing.stage
        store.pushing.stage = lambda *args, **kwargs: (staged.append(args[2]), stage(*args, **kwargs))[1]  # type: ignore[method-assign]
        if how == "in one push":
            done = store.put("t", pieces)
        elif how == "in one stream":  # a PushStream's pushes, taken by the writer together: the last waits for them
            *held, done = store.pushing.put_in_order([Push("t", [Entry.of(piece)]) for piece in pieces], timeout=30)
            assert [result.partial for result in held] == [[whole.eid.uid]] * 3
        else:
            for piece in pieces[:-1]:
                assert store.put("t", [piece]).partial == [piece.uid]
            done = store.put("t", pieces[-1:])
        assert done.stored == [whole.eid.uid] and done.completed_groups == ["0/0"]
        assert staged == list(range(len(staged))) and len(staged) >= 2  # its section, chunk after chunk
        same(read_back(store, "t", whole.eid.uid), whole)
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"], stats["pieces_pushed"]) == (0, 0, 4)
        record = store._in_table("t", lambda tt: tt.member(whole.eid.uid))
        assert record.generated == int(whole.action_mask.sum()) and record.size > 8 << 20
        with store.environment.read() as txn:
            assert chunked.staged_sets(txn, store.environment.db) == 0
        assert store.verify("t") == []
        assert store.put("t", pieces[-1:]).duplicates == [whole.eid.uid]  # sent again: a duplicate


def test_a_large_rollouts_assembly_does_not_hold_the_writer(tmp_path: Path) -> None:
    """While a large rollout's last piece puts it together (paused at its first chunk), a push into
    another table goes through the writer and returns: the writer is not held for the copy."""
    whole = long_rollout()
    first, last = (trxp.from_experience(p) for p in split(whole, [8191]))
    started, other_done = threading.Event(), threading.Event()
    with Store(tmp_path / "data", map_size=1 << 28) as store:
        store.create_table(TableConfig.of("big", estimator="none", group_size=1))
        store.create_table(TableConfig.of("small", estimator="none", group_size=1))
        store.put("big", [first])
        stage = store.pushing.stage

        def paused(*args: object, **kwargs: object) -> object:
            if not started.is_set():
                started.set()
                assert other_done.wait(60), "the other push did not come through while the rollout was copied"
            return stage(*args, **kwargs)  # type: ignore[arg-type]

        store.pushing.stage = paused  # type: ignore[method-assign]
        results: list[object] = []
        last_push = threading.Thread(target=lambda: results.append(store.put("big", [last])))
        last_push.start()
        while not started.is_set() and last_push.is_alive():
            started.wait(0.05)
        assert started.is_set(), "the rollout was not put together as a staged chunk set"
        small = trxp.from_experience(make_experience(1, 0, 0))
        assert store.put("small", [small]).stored == [small.uid]  # through the writer, the copy under way
        other_done.set()
        last_push.join(60)
        assert not last_push.is_alive() and results and results[0].stored == [whole.eid.uid]  # type: ignore[attr-defined]
        same(read_back(store, "big", whole.eid.uid), whole)


def test_pieces_that_change_while_their_rollout_is_put_together_leave_nothing_staged(tmp_path: Path) -> None:
    """A rollout whose pieces go while its last piece's push copies them (its run reported failed)
    is not stored: the last piece is refused as it would have been (no tokens held), and the chunk
    set it staged is dropped."""
    whole = long_rollout()
    first, last = (trxp.from_experience(p) for p in split(whole, [8191]))
    with Store(tmp_path / "data", map_size=1 << 28) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", [first])
        stage = store.pushing.stage
        failed: list[object] = []

        def failing(*args: object, **kwargs: object) -> object:
            if not failed:
                failed.append(store.fail_runs("t", [whole.eid.uid], []))  # its pieces go
            return stage(*args, **kwargs)  # type: ignore[arg-type]

        store.pushing.stage = failing  # type: ignore[method-assign]
        with pytest.raises(Conflict, match="but the buffer holds 0 of its tokens"):
            store.put("t", [last])
        assert failed and store.stats("t")["partials"] == 0
        with store.environment.read() as txn:
            assert chunked.staged_sets(txn, store.environment.db) == 0
        assert store.verify("t") == []


def test_a_rollout_in_pieces_is_bounded_by_the_largest_push_and_the_tables_capacity(start_server: Servers) -> None:
    """Issue 63: nothing bounded a rollout in pieces but capacity_bytes (a blocking table waited for
    room it could never have). Each piece is checked: the one with which its rollout would take
    more than the server's max_push_bytes (the largest push: the rollout is one experience), or
    the table's capacity_bytes, is refused RESOURCE_EXHAUSTED naming the bound, nothing stored."""
    server = start_server(max_push_bytes=1 << 20)
    whole = long_rollout(response=2400, run=0)  # about 2.5 MB: 2.5 MiB of routing ids in pieces of 0.4
    with BufferClient(f"127.0.0.1:{server.port}", timeout=30) as client:
        client.create_table("t", group_size=1, estimator="none")
        client.create_table("small", group_size=1, estimator="none", capacity_bytes=700_000)
        pieces = split(whole, list(range(400, 2400, 400)))
        stored = 0
        with pytest.raises(ResourceExhaustedError, match=r"more than 1048576, the server's max_push_bytes") as refused:
            for piece in pieces:
                assert client.push([piece], table="t").partial == [whole.eid.uid]
                stored += 1
        assert f"rollout {whole.eid.uid} held in pieces would take" in str(refused.value)
        assert refused.value.reason == "too_large"
        assert 0 < stored < len(pieces)
        (held,) = client.get_partials(["0/0"], table="t")  # the pieces before it, as they were
        assert held.tokens.numel() == PROMPT + 400 * stored
        with pytest.raises(ResourceExhaustedError, match="table 'small''s capacity_bytes"):
            for piece in pieces:
                client.push([piece], table="small")
        assert client.stats("t")["t"].pushed == 0


ROLLOUT_MIB = 192  # the rollout of the memory test, in pieces of 8 MiB


def memory(pid: int, figure: str) -> int:
    """A memory figure of a process's /proc status (VmRSS, VmHWM: its peak), in bytes."""
    return int(re.search(rf"{figure}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) << 10  # type: ignore[union-attr]


def test_the_servers_memory_to_put_a_large_rollout_together_is_bounded_by_its_chunks(tmp_path: Path) -> None:
    """Issue 63: a 480 MB rollout finished by a one-token piece took +1,402 MB of the server's
    memory (every piece copied, merged, packed, in the writer). Put together off the writer, a
    chunk at a time, its peak RSS grows by a few chunks (and the map pages read since the last
    ones given back), not by the rollout: here under half the rollout's size."""
    size = ROLLOUT_MIB << 20
    response = size // (WIDE + 9)
    whole = long_rollout(response=response)
    pieces = split(whole, [*range(8192, response - 1, 8192), response - 1])  # the last: one token
    with servers() as start:
        server = start(str(tmp_path / "data"), fresh=True)
        pid = server.proc.pid
        with BufferClient(server.target, timeout=300) as client:
            client.create_table("huge", group_size=1, estimator="none")
            for piece in pieces[:-1]:
                assert client.push([piece], table="huge").partial == [whole.eid.uid]
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
            before = memory(pid, "VmRSS")
            assert client.push(pieces[-1:], table="huge").stored == [whole.eid.uid]
            grown = memory(pid, "VmHWM") - before
            (got,) = client.get([whole.eid.uid], table="huge")
        assert server.proc.poll() is None, "".join(server.log)
    same(got, whole)
    assert grown < size // 2, f"the server grew {grown >> 20} MiB to put together a rollout of {ROLLOUT_MIB} MiB"
