"""SIGKILL an `expbuf serve` child at random moments while groups arrive over many pushes.

The crash loop of test_fault_crash_loop.py pushes whole groups; a rows table keeps a group whose
runs arrive over many pushes (GRPO's rollout workers, each pushing its own runs of a task) as a
pending head with its latest members' rows inline, spilled into fragments past SPILL_BYTES, and
moves them into a segment when the group completes. Here several pushers push each group's runs
in pieces from different pushes, interleaved, into a table of groups of 32 with uids of 60 bytes
(their heads spill) and one of groups of 8 (they never do); some groups complete by their last
run, some by a seal once their planned runs are acknowledged, and some are left pending through
the kills, their other runs pushed (or a seal sent) only after the last restart. A push cut by a
kill, or sent first with a deadline it may miss and at once again, is retried with the same bytes
and must come back stored or duplicate, never a conflict or a second copy; lease and consume
samplers run meanwhile, and each batch they receive must hold each of its groups whole, exactly
the members planned. At the end every acknowledged uid is live or consumed once, the pending
groups complete with every member, Stats agree with the ledger, and `expbuf check` finds the
directory consistent. EXPBUF_CRASH_SEED picks another seed, EXPBUF_SOAK_SCALE more kills.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from faultkit import (
    GONE,
    ClientLedger,
    SampleStream,
    channel,
    check_data,
    consume_sampler,
    lease_sampler,
    scaled,
    stats,
    stub,
)
from helpers import ServerProcess, group_items, wait_for

pytestmark = pytest.mark.faults

ROUNDS = scaled(2)  # kills, each followed by a restart on the killed data; more with EXPBUF_SOAK_SCALE
SEED = int(os.environ.get("EXPBUF_CRASH_SEED", "11"))  # another seed, to hunt with
PROMPT = 300  # int32 tokens: every run refers to one shared prompt, counted through the kills
LEASE_SECONDS = 2.0
WHOLE, SEALED, PENDING, PENDING_SEALED = "whole", "sealed", "pending", "pending then sealed"
FATES = (WHOLE,) * 5 + (SEALED,) * 2 + (PENDING,) * 2 + (PENDING_SEALED,)


@dataclass(frozen=True)
class Table:
    name: str
    size: int  # group_size
    uid_bytes: int  # each run's uid padded to this length (its suffix), 0: unpadded

    def create(self, buffer: pb_grpc.ExperienceBufferStub) -> None:
        config = pb.TableConfig(
            name=self.name, group_by=pb.GROUP_BY_TASK, group_size=self.size, estimator=pb.Estimator(name="grpo")
        )
        buffer.CreateTable(pb.CreateTableRequest(config=config, exist_ok=True), timeout=30)


BIG = Table("big", 32, 60)  # a head passes SPILL_BYTES after about 10 of these members: it spills
SMALL = Table("small", 8, 0)  # never spills
TABLES = (BIG, SMALL)


@functools.cache
def _template() -> trxp.RawItem:
    return group_items(0, 0, 1, prompt=PROMPT)[0]


def run_item(table: Table, task: int, run: int) -> trxp.RawItem:
    """Run `run` of task `task` of `table`'s batch, its reward varied, its uid padded to uid_bytes."""
    item = _template()
    meta = copy.deepcopy(item.meta)
    head = f"{table.name}/{task}/{run}/0/r{run}"
    meta["eid"].update(batch=table.name, task=task, run=run, suffix=f"r{run}" + "x" * (table.uid_bytes - len(head)))
    meta["reward"] = float((task * 7 + run) % 5)
    return trxp.RawItem(meta, item.tensors)


@dataclass(eq=False)
class Group:
    """One group's plan: the runs pushed during the kills, those pushed after the last restart,
    and whether a seal completes it; what was acknowledged of it."""

    table: Table
    task: int
    fate: str
    planned: list[int]
    later: list[int]
    acked: set[int] = field(default_factory=set)
    released: bool = False  # its later runs (or its late seal) may be sent
    seal_sent: bool = False

    @property
    def gid(self) -> str:
        return f"{self.table.name}/{self.task}"

    @property
    def members(self) -> list[int]:
        """The runs it completes with."""
        return sorted(self.planned + self.later)

    @property
    def sealed(self) -> bool:
        return self.fate in (SEALED, PENDING_SEALED)


Chunk = tuple[Group, list[int]]


@dataclass
class Ledger(ClientLedger):
    """What the clients were told, and the plan of every group."""

    groups: dict[str, Group] = field(default_factory=dict)
    uid_of: dict[str, tuple[Group, int]] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)  # answered as stored (never twice)
    delivered_groups: set[str] = field(default_factory=set)
    to_seal: queue.SimpleQueue[Group] = field(default_factory=queue.SimpleQueue)

    def plan(self, group: Group) -> None:
        with self.lock:
            self.groups[group.gid] = group
            for number in range(group.table.size):
                self.uid_of[run_item(group.table, group.task, number).uid] = (group, number)

    def pushed(self, sent: list[str], reply: pb.PushReply, retried: bool) -> None:
        answered = set(reply.stored_uids) | set(reply.duplicate_uids)
        with self.lock:
            if answered != set(sent) or set(reply.stored_uids) & set(reply.duplicate_uids):
                self.violations.append(f"a push of {sorted(sent)} was answered {reply}")
            if not retried and reply.duplicate_uids:
                self.violations.append(f"a first push was answered duplicates {sorted(reply.duplicate_uids)[:3]}")
            twice = self.stored & set(reply.stored_uids)
            if twice:
                self.violations.append(f"{len(twice)} uid(s) stored a second time, e.g. {sorted(twice)[:2]}")
            self.stored |= set(reply.stored_uids)
            self.acked |= answered
            for gid in reply.completed_groups:
                group = self.groups[gid]
                if group.sealed or (group.later and not group.released):
                    self.violations.append(f"a push completed {gid} ({group.fate}), which lacks runs")
            for uid in answered:
                group, number = self.uid_of[uid]
                before = len(group.acked)
                group.acked.add(number)
                if group.fate == SEALED and before < len(group.planned) == len(group.acked):
                    self.to_seal.put(group)

    def deliver(self, uids: list[str], gids: list[str], how: str) -> None:
        """A batch received: nothing in it consumed before, each of its groups whole and due."""
        with self.lock:
            self.delivered_again(uids, how)
            runs: dict[str, list[int]] = {}
            for uid, gid in zip(uids, gids, strict=True):
                group, number = self.uid_of[uid]
                if group.gid != gid:
                    self.violations.append(f"{how} delivered {uid} in group {gid}")
                runs.setdefault(gid, []).append(number)
            for gid, numbers in runs.items():
                group = self.groups[gid]
                if sorted(numbers) != group.members:
                    self.violations.append(f"{how} delivered {gid} ({group.fate}) with runs {sorted(numbers)}")
                if (group.later and not group.released) or (group.sealed and not group.seal_sent):
                    self.violations.append(f"{how} delivered {gid} ({group.fate}) before it could complete")
            self.delivered_groups |= runs.keys()


class Planner:
    """Plans groups a few at a time and deals their runs, in pieces, to the pushers' queues."""

    def __init__(self, ledger: Ledger, pushers: int, rng: random.Random) -> None:
        self.ledger, self.rng, self.lock = ledger, rng, threading.Lock()
        self.queues: list[list[Chunk]] = [[] for _ in range(pushers)]
        self.tasks = 0

    def wave(self) -> None:
        with self.lock:
            for table in (BIG, SMALL, SMALL):
                fate, runs = self.rng.choice(FATES), list(range(table.size))
                self.rng.shuffle(runs)
                cut = len(runs) if fate == WHOLE else self.rng.randint(1, table.size - 1)
                group = Group(table, self.tasks, fate, runs[:cut], runs[cut:] if fate == PENDING else [])
                self.tasks += 1
                self.ledger.plan(group)
                at = 0
                while at < cut:
                    size = self.rng.randint(1, max(1, table.size // 4))
                    self.rng.choice(self.queues).append((group, group.planned[at : at + size]))
                    at += size

    def take(self, number: int) -> list[Chunk]:
        """Pusher `number`'s next push: its next piece and up to two more of the same table."""
        with self.lock:
            mine = self.queues[number]
            if not mine:
                return []
            table, count = mine[0][0].table, self.rng.randint(1, 3)
            taken = [chunk for chunk in mine if chunk[0].table == table][:count]
            for chunk in taken:
                mine.remove(chunk)
            return taken


@dataclass(eq=False)
class Push:
    """A push's table, its bytes (sent again as they are) and its uids; `cut`: a kill cut it, and it
    may have been stored."""

    table: Table
    data: bytes
    uids: list[str]
    cut: bool = False

    def request(self, seq: int = 0) -> pb.PushRequest:
        return pb.PushRequest(table=self.table.name, seq=seq, payload=self.data)


class Pusher:
    """Unary pushes of pieces of groups; a push cut by a kill is retried with the same bytes."""

    def __init__(self, number: int, planner: Planner, ledger: Ledger) -> None:
        self.number, self.planner, self.ledger = number, planner, ledger
        self.unanswered: list[Push] = []  # sent (or about to be) and not answered, oldest first

    def fresh(self, plan: bool) -> Push | None:
        """Its next push of its queue's pieces (more groups planned first where `plan` and it is
        empty); None: nothing left."""
        chunks = self.planner.take(self.number)
        if not chunks and plan:
            self.planner.wave()
            chunks = self.planner.take(self.number)
        if not chunks:
            return None
        items = [run_item(group.table, group.task, n) for group, runs in chunks for n in runs]
        push = Push(chunks[0][0].table, trxp.build(items), [item.uid for item in items])
        self.unanswered.append(push)
        return push

    def answered(self, push: Push, reply: pb.PushReply) -> None:
        self.ledger.pushed(push.uids, reply, push.cut)
        self.unanswered.remove(push)

    def broken(self, exc: grpc.RpcError) -> None:
        """A call a kill (or anything else) broke: what it left unanswered is retried."""
        for push in self.unanswered:
            push.cut = True
        if exc.code() not in GONE:
            self.ledger.unexpected(f"{type(self).__name__} {self.number}", exc)

    def run(self, target: str, stop: threading.Event) -> None:
        """Push until stopped (planning more groups as needed), then only what a kill cut; where
        stopped before it began, push what its queue holds, planning nothing."""
        emptying = stop.is_set()
        with channel(target) as chan:
            buffer = stub(chan)
            while True:
                push = self.unanswered[0] if self.unanswered else None
                if push is None and (emptying or not stop.is_set()):
                    push = self.fresh(plan=not stop.is_set())
                if push is None:
                    return
                try:
                    if not push.cut and self.planner.rng.random() < 0.1:
                        self.hasty(buffer, push)
                    reply = buffer.Push(push.request(), timeout=10)
                except grpc.RpcError as exc:
                    self.broken(exc)
                    return
                self.answered(push, reply)

    def hasty(self, buffer: pb_grpc.ExperienceBufferStub, push: Push) -> None:
        """The push sent first with a deadline it may miss while the server stores it: the retry
        that follows at once may meet it in the writer's queue, or in its batch."""
        push.cut = True
        call = buffer.Push.future(push.request(), timeout=self.planner.rng.uniform(0.001, 0.02))
        call.add_done_callback(lambda done: self.hastily(push, done))

    def hastily(self, push: Push, call: grpc.Future) -> None:
        """A hasty push's answer, where it had one: as a retry's, the same uids stored or duplicates."""
        exc = call.exception()
        if exc is None:
            self.ledger.pushed(push.uids, call.result(), retried=True)
        elif not isinstance(exc, grpc.RpcError) or exc.code() not in GONE:
            with self.ledger.lock:
                self.ledger.violations.append(f"a hasty push by pusher {self.number}: {exc!r}")


class StreamPusher(Pusher):
    """PushStream with up to 4 pushes in flight (stored in one commit where they meet the writer
    together); those a kill cut are sent again first, on the next stream."""

    def run(self, target: str, stop: threading.Event) -> None:
        emptying, window, ended = stop.is_set(), threading.Semaphore(4), threading.Event()
        sent: dict[int, Push] = {}
        resend = list(self.unanswered)

        def requests() -> Iterator[pb.PushRequest]:
            seq = 0
            while True:
                while not window.acquire(timeout=0.05):
                    if ended.is_set() or (stop.is_set() and not resend and not emptying):
                        return
                if resend:
                    push: Push | None = resend.pop(0)
                elif stop.is_set() and not emptying:
                    return
                else:
                    push = self.fresh(plan=not stop.is_set())
                if push is None:
                    return
                seq += 1
                sent[seq] = push
                yield push.request(seq)

        with channel(target) as chan:
            try:
                for reply in stub(chan).PushStream(requests(), timeout=60):
                    self.answered(sent.pop(reply.seq), reply)
                    window.release()
            except grpc.RpcError as exc:
                ended.set()  # first: a push its requests take after this is never sent
                self.broken(exc)
            finally:
                ended.set()


def sealer(target: str, stop: threading.Event, ledger: Ledger, cut: list[Group]) -> None:
    """Seals each group whose planned runs were acknowledged (`cut`: seals a kill cut, sent again
    first); a retried seal may find its group complete, a first one must seal every planned run."""
    with channel(target) as chan:
        buffer = stub(chan)
        while not stop.is_set() or cut or not ledger.to_seal.empty():
            retried = bool(cut)
            if cut:
                group = cut[0]
            else:
                try:
                    group = ledger.to_seal.get(timeout=0.05)
                except queue.Empty:
                    continue
                cut.append(group)
            group.seal_sent = True
            try:
                size = buffer.Seal(pb.SealRequest(table=group.table.name, group_id=group.gid), timeout=10).size
            except grpc.RpcError as exc:
                done = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
                if retried and exc.code() in done:
                    cut.pop(0)
                    continue
                if exc.code() not in GONE:
                    ledger.unexpected(f"a seal of {group.gid}", exc)
                return
            cut.pop(0)
            if size != len(group.members):
                with ledger.lock:
                    ledger.violations.append(f"a seal of {group.gid} answered {size} of {group.members}")


def alive(server: ServerProcess) -> None:
    """Fail at once, with its log, where the child died unbidden."""
    if server.proc.poll() is not None:
        code = server.stop(signal.SIGKILL)  # of a dead child: its exit code, once its log is read to the end
        raise AssertionError(f"the server exited ({code}):\n" + "".join(server.log))


@contextlib.contextmanager
def watched(server: ServerProcess) -> Iterator[None]:
    """Calls to the child: one that fails because the child died fails with its log."""
    try:
        yield
    except Exception:
        alive(server)
        raise


def run_load(
    server: ServerProcess,
    seconds: float,
    pushers: list[Pusher],
    ledger: Ledger,
    cut_seals: list[Group],
    kill: Callable[[], None],
) -> None:
    """Run every worker for `seconds` (the child watched), then call `kill` (or nothing) and stop them."""
    target, stop = server.target, threading.Event()
    workers = [threading.Thread(target=p.run, args=(target, stop)) for p in pushers]
    workers.append(threading.Thread(target=sealer, args=(target, stop, ledger, cut_seals)))
    for table in TABLES:
        workers += [
            threading.Thread(
                target=lease_sampler, args=(target, stop, ledger, table.name), kwargs={"lease_seconds": LEASE_SECONDS}
            ),
            threading.Thread(target=consume_sampler, args=(target, stop, ledger, table.name), kwargs={"num_groups": 1}),
        ]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            alive(server)
            time.sleep(0.05)
        kill()
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert not any(worker.is_alive() for worker in workers), "a load worker hung"


def push_rest(server: ServerProcess, pushers: list[Pusher], ledger: Ledger, cut_seals: list[Group]) -> None:
    """Push what every pusher's queue still holds and the seals due, with no kill and no samplers."""
    stop = threading.Event()
    stop.set()
    workers = [threading.Thread(target=p.run, args=(server.target, stop)) for p in pushers]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    last = threading.Thread(target=sealer, args=(server.target, stop, ledger, cut_seals))
    last.start()  # after the pushes: a seal is due once they are acknowledged
    last.join(120)
    alive(server)
    assert not any(worker.is_alive() for worker in [*workers, last]), "a pusher or the sealer hung"
    assert not ledger.violations, "\n".join(ledger.violations[:10])
    assert not any(p.unanswered for p in pushers) and not any(pushers[0].planner.queues) and not cut_seals


def totals(buffer: pb_grpc.ExperienceBufferStub) -> dict[str, int]:
    """Both tables' counts of the fields checked, added up."""
    names: tuple[str, ...] = ("pending", "groups_pending", "computing", "ready", "leased", "consumed", "pushed")
    names += ("groups_failed", "groups_dropped")
    each = [stats(buffer, table.name) for table in TABLES]
    return {name: sum(getattr(s, name) for s in each) for name in names}


def live_uids(buffer: pb_grpc.ExperienceBufferStub, ledger: Ledger) -> set[str]:
    live: set[str] = set()
    for table in TABLES:
        mine = sorted(uid for uid in ledger.acked if uid.startswith(f"{table.name}/"))
        for start in range(0, len(mine), 500):
            chunk = mine[start : start + 500]
            missing = set(buffer.Get(pb.GetRequest(table=table.name, uids=chunk), timeout=30).missing_uids)
            live.update(set(chunk) - missing)
    return live


def settled(buffer: pb_grpc.ExperienceBufferStub) -> dict[str, int]:
    """The totals once no lease taken before a stop is left and nothing computes."""
    wait_for(lambda: totals(buffer)["leased"] == 0, "the leases taken before the stop expired", 60)
    wait_for(lambda: totals(buffer)["computing"] == 0, "the groups computed", 60)
    return totals(buffer)


def check_counts(buffer: pb_grpc.ExperienceBufferStub, ledger: Ledger) -> set[str]:
    """Every acknowledged uid live or consumed (not both), Stats agreeing with the ledger and the
    plan's pending runs; the live uids."""
    s = settled(buffer)
    live = live_uids(buffer, ledger)
    lost = ledger.acked - live - ledger.consumed.keys() - ledger.uncertain
    assert not lost, f"{len(lost)} acknowledged uid(s) neither stored nor consumed, e.g. {sorted(lost)[:3]}"
    back = live & ledger.consumed.keys()
    assert not back, f"{len(back)} consumed uid(s) are stored again, e.g. {sorted(back)[:3]}"
    assert s["pushed"] == len(ledger.acked), f"Stats count {s['pushed']} pushed, {len(ledger.acked)} acknowledged"
    assert s["groups_failed"] == 0 and s["groups_dropped"] == 0, s
    assert s["pending"] + s["ready"] == len(live), f"Stats count {s} but {len(live)} are live"
    assert s["consumed"] == s["pushed"] - len(live), s
    waiting = [
        g
        for g in ledger.groups.values()
        if g.acked and (len(g.acked) < len(g.members) or (not g.seal_sent and g.sealed))
    ]
    assert s["pending"] == sum(len(g.acked) for g in waiting), f"Stats count {s['pending']} pending"
    assert s["groups_pending"] == len(waiting), f"Stats count {s['groups_pending']} groups pending, not {len(waiting)}"
    return live


@pytest.mark.soak
def test_crash_loop_with_groups_over_many_pushes(tmp_path: Path, serve: Callable[..., ServerProcess]) -> None:
    rng = random.Random(SEED)
    data = tmp_path / "data"
    ledger = Ledger()
    planner = Planner(ledger, 3, rng)
    pushers = [Pusher(0, planner, ledger), Pusher(1, planner, ledger), StreamPusher(2, planner, ledger)]
    cut_seals: list[Group] = []
    for round_ in range(ROUNDS):
        server = serve(str(data))
        with channel(server.target) as chan, watched(server):
            for table in TABLES:
                table.create(stub(chan))

        def kill(server: ServerProcess = server) -> None:
            # On a busy machine the load may not have had a push answered yet: the kill waits for one.
            deadline = time.monotonic() + 60
            while not ledger.acked and time.monotonic() < deadline:
                time.sleep(0.05)
            alive(server)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)

        run_load(server, rng.uniform(0.1, 2.0), pushers, ledger, cut_seals, kill)
        assert ledger.acked, f"round {round_}: nothing was acknowledged"
    assert not ledger.violations, "\n".join(ledger.violations[:10])

    # Resume without a kill: every push and seal a kill cut is answered, the planned runs pushed.
    server = serve(str(data))
    with watched(server):
        push_rest(server, pushers, ledger, cut_seals)
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    checked = check_data(data)
    assert checked.returncode == 0, f"expbuf check after the crash loop:\n{checked.stdout}{checked.stderr}"

    server = serve(str(data))
    with channel(server.target) as chan, watched(server):
        buffer = stub(chan)
        check_counts(buffer, ledger)
        # After the restart, the runs held back arrive and the late seals are sent: every group completes.
        with ledger.lock:
            for group in ledger.groups.values():
                group.released = True
                if group.later:
                    planner.queues[rng.randrange(3)].append((group, group.later))
                elif group.fate == PENDING_SEALED:
                    ledger.to_seal.put(group)
        push_rest(server, pushers, ledger, cut_seals)
        live = check_counts(buffer, ledger)
        assert totals(buffer)["pending"] == 0
        drain(buffer, ledger)
        s = totals(buffer)
        assert s["ready"] == 0 and s["consumed"] == s["pushed"] == len(ledger.acked), s
        assert not ledger.violations, "\n".join(ledger.violations[:10])
        complete = {g.gid for g in ledger.groups.values() if g.acked}
        assert complete <= ledger.delivered_groups, f"never delivered: {sorted(complete - ledger.delivered_groups)[:5]}"
        assert live <= ledger.consumed.keys()
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    checked = check_data(data)
    assert checked.returncode == 0, f"expbuf check at the end:\n{checked.stdout}{checked.stderr}"


def drain(buffer: pb_grpc.ExperienceBufferStub, ledger: Ledger) -> None:
    """Lease and ack everything ready in both tables, in batches up to a partial one."""
    for table in TABLES:
        request = pb.SampleRequest(
            table=table.name,
            num_groups=64,
            delivery=pb.DELIVERY_LEASE,
            lease_seconds=60,
            wait_seconds=0.2,  # every group is ready before: the wait only ends the last, empty stream
            allow_partial=True,
        )
        while True:
            got = 0
            for reply in SampleStream(buffer, request):
                ledger.deliver(list(reply.uids), list(reply.group_ids), "the final drain")
                buffer.Ack(pb.AckRequest(table=table.name, lease_id=reply.lease_id), timeout=30)
                ledger.consume(list(reply.uids), "acked by the final drain")
                got += 1
            if not got:
                break
