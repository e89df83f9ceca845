"""SIGKILL an `expbuf serve` child at random moments under mixed load, restart it on the same data.

Pushers (unary Push and PushStream), lease samplers that ack every other batch and
consume samplers run against the server until it is killed; then it is restarted on the
same directory and the load resumes, for several rounds. A ledger records what the
clients were told: acknowledged uids, deliveries, and which deliveries are consumed for
sure (acked, or a consume batch the stream moved past or ended after). At the end every
acknowledged uid is live or was consumed, nothing consumed is delivered again or still
stored, leases never acked come back, Stats agree with the ledger, and `expbuf check`
finds the stopped directory consistent, the count of the prompt every run shares among it.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from faultkit import (
    GONE,
    ClientLedger,
    SampleStream,
    channel,
    check_data,
    computed,
    consume_sampler,
    lease_sampler,
    payload,
    sample_all,
    scaled,
    stats,
    stub,
)
from helpers import ServerProcess, wait_for

pytestmark = pytest.mark.faults


ROUNDS = scaled(2)  # a kill, a restart on the killed data, a second kill; more with EXPBUF_SOAK_SCALE
PROMPT = 300  # int32 tokens: every group's runs refer to one shared prompt, counted through the kills
LEASE_SECONDS = 2.0


class Ledger(ClientLedger):
    """What the clients were told, in the order they were told it."""

    def pushed(self, sent: list[str], reply: pb.PushReply) -> None:
        answered = set(reply.stored_uids) | set(reply.duplicate_uids)
        with self.lock:
            if answered != set(sent):
                self.violations.append(f"a push of {sorted(sent)} was answered for {sorted(answered)}")
            self.acked |= answered


class Pusher:
    """Unary pushes of whole groups; a push cut by a kill is retried with the same bytes later."""

    def __init__(self, name: str, ledger: Ledger) -> None:
        self.name, self.ledger, self.task = name, ledger, 0
        self.unanswered: list[tuple[bytes, list[str]]] = []

    def _next(self) -> tuple[bytes, list[str]]:
        if not self.unanswered:
            self.unanswered.append(payload(self.name, self.task, prompt=PROMPT))
            self.task += 1
        return self.unanswered[0]

    def run(self, target: str, stop: threading.Event) -> None:
        with channel(target) as chan:
            buffer = stub(chan)
            while not stop.is_set() or self.unanswered:
                data, uids = self._next()
                try:
                    reply = buffer.Push(pb.PushRequest(payload=data), timeout=10)
                except grpc.RpcError as exc:
                    if exc.code() not in GONE:
                        self.ledger.unexpected(f"Push by {self.name}", exc)
                    return
                self.ledger.pushed(uids, reply)
                self.unanswered.pop(0)


class StreamPusher(Pusher):
    """PushStream with up to 4 payloads in flight; the unanswered ones are sent again after a kill."""

    def run(self, target: str, stop: threading.Event) -> None:
        window = threading.Semaphore(4)
        ended = threading.Event()
        sent: dict[int, tuple[bytes, list[str]]] = {}
        resend = list(self.unanswered)

        def requests() -> Iterator[pb.PushRequest]:
            seq = 0
            while True:
                while not window.acquire(timeout=0.1):
                    if ended.is_set() or (stop.is_set() and not resend):
                        return
                if resend:
                    item = resend.pop(0)
                elif stop.is_set():
                    return
                else:
                    item = payload(self.name, self.task, prompt=PROMPT)
                    self.task += 1
                    self.unanswered.append(item)
                seq += 1
                sent[seq] = item
                yield pb.PushRequest(seq=seq, payload=item[0])

        with channel(target) as chan:
            try:
                for reply in stub(chan).PushStream(requests(), timeout=60):
                    item = sent.pop(reply.seq)
                    self.ledger.pushed(item[1], reply)
                    self.unanswered.remove(item)
                    window.release()
            except grpc.RpcError as exc:
                if exc.code() not in GONE:
                    self.ledger.unexpected(f"PushStream by {self.name}", exc)
            finally:
                ended.set()


def run_load(target: str, seconds: float, pushers: list[Pusher], ledger: Ledger, before_stop: Callable[[], None]):
    """Run every worker for `seconds`, then call before_stop (a kill, or nothing) and stop them."""
    stop = threading.Event()
    workers = [threading.Thread(target=p.run, args=(target, stop)) for p in pushers]
    workers += [
        threading.Thread(target=lease_sampler, args=(target, stop, ledger), kwargs={"lease_seconds": LEASE_SECONDS}),
        threading.Thread(target=consume_sampler, args=(target, stop, ledger)),
        threading.Thread(target=consume_sampler, args=(target, stop, ledger), kwargs={"window": 3}),
    ]
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    before_stop()
    stop.set()
    for worker in workers:
        worker.join(60)
        assert not worker.is_alive(), "a load worker hung"


def drain(target: str, ledger: Ledger) -> set[str]:
    """Lease and ack everything ready, in batches up to a partial one; the uids received."""
    got: set[str] = set()
    with channel(target) as chan:
        buffer = stub(chan)
        request = pb.SampleRequest(
            num_groups=64, delivery=pb.DELIVERY_LEASE, lease_seconds=60, wait_seconds=1.0, allow_partial=True
        )
        while True:
            before = len(got)
            for reply in SampleStream(buffer, request):
                ledger.deliver(list(reply.uids), list(reply.group_ids), "the final drain")
                buffer.Ack(pb.AckRequest(lease_id=reply.lease_id), timeout=30)
                ledger.consume(list(reply.uids), "acked by the final drain")
                got.update(reply.uids)
            if len(got) == before:
                return got


def leases_expired(buffer: pb_grpc.ExperienceBufferStub) -> None:
    """Wait until every lease taken before the last stop has expired and its groups are back
    (the restarted server finds the leases and its upkeep ends them past their LEASE_SECONDS)."""
    wait_for(lambda: stats(buffer).leased == 0, "the leases taken before the stop expired", 60)


def lease_then_kill(server: ServerProcess) -> list[str]:
    """Push two groups, lease them without acking, SIGKILL the server; the leased uids."""
    with channel(server.target) as chan:
        buffer = stub(chan)
        for task in range(2):
            buffer.Push(pb.PushRequest(payload=payload("expiry", task)[0]), timeout=30)
        computed(buffer)  # a server that started with nothing to compute loads its torch at these pushes
        request = pb.SampleRequest(
            num_groups=2, delivery=pb.DELIVERY_LEASE, lease_seconds=LEASE_SECONDS, wait_seconds=10, max_batches=1
        )
        (reply,) = sample_all(buffer, request, timeout=30)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    return list(reply.uids)


@pytest.mark.soak
def test_crash_loop_under_mixed_load(tmp_path: Path, serve: Callable[..., ServerProcess]) -> None:
    rng = random.Random(8)
    data = tmp_path / "data"
    ledger = Ledger()
    pushers = [Pusher("unary0", ledger), Pusher("unary1", ledger), StreamPusher("stream0", ledger)]
    for round_ in range(ROUNDS):
        server = serve(str(data))

        def kill(server: ServerProcess = server) -> None:
            # On a busy machine the load may not have had a push answered yet: the kill waits for one.
            deadline = time.monotonic() + 60
            while not ledger.acked and time.monotonic() < deadline:
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)

        run_load(server.target, rng.uniform(0.5, 2.0), pushers, ledger, kill)
        assert ledger.acked, f"round {round_}: nothing was acknowledged"
    assert not ledger.violations, "\n".join(ledger.violations[:10])

    # Resume once more without a kill: every push cut by a kill is answered now.
    server = serve(str(data))
    run_load(server.target, 0.5, pushers, ledger, lambda: None)
    assert not any(p.unanswered for p in pushers)
    assert server.stop(signal.SIGTERM) == 0
    checked = check_data(data)
    assert checked.returncode == 0, f"expbuf check after the crash loop:\n{checked.stdout}{checked.stderr}"

    server = serve(str(data))
    with channel(server.target) as chan:
        buffer = stub(chan)
        leases_expired(buffer)
        acked = sorted(ledger.acked)
        live: set[str] = set()
        for start in range(0, len(acked), 500):
            chunk = acked[start : start + 500]
            missing = set(buffer.Get(pb.GetRequest(uids=chunk), timeout=30).missing_uids)
            live.update(set(chunk) - missing)
        lost = ledger.acked - live - ledger.consumed.keys() - ledger.uncertain
        assert not lost, f"{len(lost)} acknowledged uid(s) neither stored nor consumed, e.g. {sorted(lost)[:3]}"
        back = live & ledger.consumed.keys()
        assert not back, f"{len(back)} consumed uid(s) are stored again, e.g. {sorted(back)[:3]}"

        deadline = time.monotonic() + 30
        while (s := stats(buffer)).computing and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.pushed == len(ledger.acked), "Stats.pushed differs from the acknowledged uids"
        assert s.evicted == 0 and s.groups_failed == 0 and s.groups_dropped == 0, s
        assert s.pending + s.computing + s.ready + s.leased == len(live), f"Stats count {s} but {len(live)} are live"
        assert s.consumed == s.pushed - len(live), s

        drain(server.target, ledger)
        s = stats(buffer)
        assert s.ready == 0 and s.consumed == s.pushed - s.leased - s.pending - s.computing, s
        assert not ledger.violations, "\n".join(ledger.violations[:10])

    leased = lease_then_kill(server)
    server = serve(str(data))
    with channel(server.target) as chan:
        leases_expired(stub(chan))
    returned = drain(server.target, ledger)
    assert set(leased) <= returned, f"leases taken before a SIGKILL did not return after expiry: {leased}"
    assert server.stop(signal.SIGTERM) == 0
    checked = check_data(data)
    assert checked.returncode == 0, f"expbuf check at the end:\n{checked.stdout}{checked.stderr}"
