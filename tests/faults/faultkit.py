"""What the fault tests share: raw stubs, payloads, and a server child's CPU time and memory."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.rpc.interceptors.base import Interceptors
from expbuf.server.rpc.interceptors.metrics import Metrics
from expbuf.server.rpc.push.inflight import TRIM_IDLE
from expbuf.server.rpc.sample.replies import PassBytes
from expbuf.server.rpc.service import ExperienceBufferService
from expbuf.server.store import Store

import cli_forks
from helpers import group_items, serving, wait_for
from helpers import servers as servers  # the fault modules that start children in a `with` block import it here

SCALE = int(os.environ.get("EXPBUF_SOAK_SCALE", "1"))
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)  # cut by a kill
SERVICE = "expbuf.v1.ExperienceBuffer"
MAX_MESSAGE = 256 << 20


def scaled(count: int) -> int:
    """A count of rounds or operations, lengthened by EXPBUF_SOAK_SCALE."""
    return max(1, count * SCALE)


@contextlib.contextmanager
def service_over(store: Store) -> Iterator[str]:
    """The gRPC service over a Store built here (for settings `expbuf serve` has no flag for),
    on a free loopback port; its target. Its streams' replies go out as the server's do (PassBytes)."""
    service = ExperienceBufferService(store, metrics=Metrics(store), max_message_bytes=16 << 20, advantage_device="cpu")
    with serving(service, [Interceptors([PassBytes()])]) as target:
        yield target


def channel(target: str) -> grpc.Channel:
    options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
    return grpc.insecure_channel(target, options=options)


def cut_push(
    payload: bytes, table: str, chunk: int, sent: int, asked: threading.Event, hold: threading.Event
) -> Iterator[pb.PushRequest]:
    """A PushStream of one push in chunks that stops after `sent` of them, never finished: it sets
    `asked`, waits for `hold` (the server is killed meanwhile) and ends."""
    for number, at in enumerate(range(0, len(payload), chunk)):
        if number == sent:
            asked.set()
            hold.wait(120)
            return
        first = number == 0
        yield pb.PushRequest(
            table=table if first else "",
            payload=payload[at : at + chunk],
            seq=1 if first else 0,
            total_bytes=len(payload) if first else 0,
        )


def stub(chan: grpc.Channel) -> pb_grpc.ExperienceBufferStub:
    return pb_grpc.ExperienceBufferStub(chan)


def healthy(chan: grpc.Channel, timeout: float = 5.0) -> bool:
    """The standard health check answers SERVING for the expbuf service."""
    reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@functools.cache
def _template(size: int, prompt: int) -> tuple[trxp.RawItem, ...]:
    return tuple(group_items(0, 0, size, prompt=prompt))


def group(batch: str, task: int, size: int = 4, prompt: int = 3) -> list[trxp.RawItem]:
    """A whole group of `size` runs of one task, relabelled from a cached template (of `prompt`
    int32 prompt tokens: from 256, the store keeps the prompt, the same in every group, once)."""
    items = []
    for run, item in enumerate(_template(size, prompt)):
        meta = copy.deepcopy(item.meta)
        meta["eid"].update(batch=batch, task=task, run=run, suffix=f"r{run}")
        items.append(trxp.RawItem(meta, item.tensors))
    return items


def payload(batch: str, task: int, size: int = 4, prompt: int = 3) -> tuple[bytes, list[str]]:
    """TRXP bytes of one whole group, and its uids."""
    items = group(batch, task, size, prompt)
    return trxp.build(items), [item.uid for item in items]


class SampleStream:
    """A raw Sample conversation, as BufferClient holds it: the request, then a confirmation
    of each batch as it arrives, which also asks for the next one.

    `close()` ends the client's side (the stream ends normally); `stop()` asks for nothing
    more; `cancel()` breaks off.
    """

    def __init__(self, buffer: pb_grpc.ExperienceBufferStub, request: pb.SampleRequest, timeout: float = 60) -> None:
        self._out: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        self._out.put(request)
        self.received = 0
        self.call = buffer.Sample(iter(self._out.get, None), timeout=timeout)

    def next(self) -> pb.SampleReply:
        """The next batch, confirmed; StopIteration when the server ended the stream."""
        reply = next(self.call)
        self.received += 1
        self._out.put(pb.SampleRequest(received=self.received))
        return reply

    def __iter__(self) -> Iterator[pb.SampleReply]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def close(self) -> list[pb.SampleReply]:
        """End the client's side; what the server still sent."""
        self._out.put(None)
        return list(self.call)

    def stop(self) -> list[pb.SampleReply]:
        """Confirm what arrived and ask for nothing more; what the server still sent."""
        self.stop_now()
        return list(self.call)

    def stop_now(self) -> None:
        """Confirm `received` and ask for nothing more, leaving what the server still sends to be read."""
        self._out.put(pb.SampleRequest(received=self.received, stop=True))
        self._out.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self._out.put(None)


def sample_all(buffer: pb_grpc.ExperienceBufferStub, request: pb.SampleRequest, timeout: float = 60) -> list:
    """Every batch of a stream that the server ends (max_batches, a partial batch), each confirmed."""
    stream = SampleStream(buffer, request, timeout)
    replies = list(stream)
    stream.close()
    return replies


def stats(buffer: pb_grpc.ExperienceBufferStub, table: str = "default") -> pb.TableStats:
    return buffer.Stats(pb.StatsRequest(table=table), timeout=10).tables[0]


def computed(buffer: pb_grpc.ExperienceBufferStub, table: str = "default") -> None:
    """Wait until no group of `table` is computing its advantages: a child loads its torch at its
    first push to a table with an estimator (seconds, far more under load), and a sample that
    waits a few seconds for ready groups meanwhile ends DEADLINE_EXCEEDED."""
    wait_for(lambda: not stats(buffer, table).groups_computing, f"the groups pushed to {table} computed")


def check_data(data: Path) -> subprocess.CompletedProcess:
    """`expbuf check` of a stopped server's data directory."""
    return cli_forks.run("check", "--data", str(data), timeout=120)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_bytes(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} for process {pid}")


def reset_peak_rss(pid: int) -> int:
    """Restart a process's peak-RSS count (VmHWM) from its present RSS; that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """The most resident memory a process has held since the last reset_peak_rss."""
    return _status_bytes(pid, "VmHWM")


def trimmed(pid: int, at_most: float) -> None:
    """Wait until a server child has handed back what the pushes that just ended freed: it trims its
    heap once no push has held memory for TRIM_IDLE (server/rpc/push/inflight.py). Done once its
    anonymous memory has fallen 8 MiB or more since the call, no sooner than TRIM_IDLE, and held
    within 1 MiB for 0.2 s; else after `at_most` seconds (the fixed wait that was here before)."""
    began = time.monotonic()
    start = last = _status_bytes(pid, "RssAnon")
    steady_from = began
    while time.monotonic() - began < at_most:
        time.sleep(0.05)
        anon, now = _status_bytes(pid, "RssAnon"), time.monotonic()
        if abs(anon - last) > 1 << 20:
            last, steady_from = anon, now
        if start - anon >= 8 << 20 and now - began >= TRIM_IDLE and now - steady_from >= 0.2:
            return


# ---- a crash loop's clients ------------------------------------------------------------------


@dataclass
class ClientLedger:
    """What a crash loop's clients were told, in the order they were told it: the uids acknowledged,
    those consumed for sure and those maybe consumed (a reply or a stream cut by a kill), and the
    rules broken (`violations`). A crash loop's own ledger adds its pushes' checks."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: set[str] = field(default_factory=set)
    consumed: dict[str, str] = field(default_factory=dict)  # consumed for sure: uid -> how
    uncertain: set[str] = field(default_factory=set)  # maybe consumed: the reply or the stream was cut
    violations: list[str] = field(default_factory=list)

    def deliver(self, uids: list[str], gids: list[str], how: str) -> None:
        """A batch received (its uids and their groups'): nothing in it consumed before."""
        with self.lock:
            self.delivered_again(uids, how)

    def delivered_again(self, uids: list[str], how: str) -> None:
        """Under the lock: a violation where a batch holds uids consumed before."""
        again = sorted(self.consumed.keys() & set(uids))
        if again:
            self.violations.append(
                f"{how} delivered {len(again)} uid(s) again that were consumed ({self.consumed[again[0]]}), "
                f"e.g. {again[:2]}"
            )

    def consume(self, uids: list[str], how: str) -> None:
        with self.lock:
            self.consumed.update(dict.fromkeys(uids, how))

    def maybe_consumed(self, uids: list[str]) -> None:
        with self.lock:
            self.uncertain.update(uids)

    def unexpected(self, what: str, exc: grpc.RpcError) -> None:
        with self.lock:
            self.violations.append(f"{what}: {exc.code().name}: {exc.details()}")


def _of(what: str, table: str) -> str:
    return f"{what} of {table}" if table else what


def lease_sampler(
    target: str, stop: threading.Event, ledger: ClientLedger, table: str = "", lease_seconds: float = 2.0
) -> None:
    """Leases batches of two groups of `table`; acks every other one and leaves the rest to expire."""
    with channel(target) as chan:
        buffer = stub(chan)
        count = 0
        while not stop.is_set():
            request = pb.SampleRequest(
                table=table, num_groups=2, delivery=pb.DELIVERY_LEASE, lease_seconds=lease_seconds, wait_seconds=0.5
            )
            stream = SampleStream(buffer, request, timeout=30)
            try:
                for reply in stream:
                    uids = list(reply.uids)
                    ledger.deliver(uids, list(reply.group_ids), "a lease")
                    count += 1
                    if count % 2 == 0:
                        try:
                            buffer.Ack(pb.AckRequest(table=table, lease_id=reply.lease_id), timeout=10)
                            ledger.consume(uids, "acked under a lease")
                        except grpc.RpcError as exc:
                            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: expired first, it is back
                                ledger.maybe_consumed(uids)
                                raise
                    if stop.is_set():
                        stream.stop()
                        break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # nothing ready in time: ask again
                    continue
                if exc.code() not in GONE:
                    ledger.unexpected(_of("a lease sampler", table), exc)
                return


def consume_sampler(
    target: str, stop: threading.Event, ledger: ClientLedger, table: str = "", window: int = 1, num_groups: int = 2
) -> None:
    """Raw DELIVERY_CONSUME streams of up to 4 batches of `table`, `window` ahead. A batch is consumed
    for sure once the server has sent the one `window` after it (it takes that only in the commit
    that consumes the confirmed ones) or ended the stream normally; the last `window` batches of a
    cut stream may come back."""
    with channel(target) as chan:
        buffer = stub(chan)
        while not stop.is_set():
            request = pb.SampleRequest(
                table=table,
                num_groups=num_groups,
                delivery=pb.DELIVERY_CONSUME,
                wait_seconds=0.5,
                max_batches=4,
                window=window,
            )
            recent: list[list[str]] = []  # the batches that may not be consumed yet, oldest first
            try:
                for reply in SampleStream(buffer, request, timeout=30):
                    uids = list(reply.uids)
                    ledger.deliver(uids, list(reply.group_ids), "a consume stream")
                    recent.append(uids)
                    if len(recent) > window:
                        ledger.consume(recent.pop(0), "a consume stream moved a window past it")
                for uids in recent:
                    ledger.consume(uids, "a batch of a consume stream that ended normally")
            except grpc.RpcError as exc:
                for uids in recent:
                    ledger.maybe_consumed(uids)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # nothing ready in time: ask again
                    continue
                if exc.code() not in GONE:
                    ledger.unexpected(_of("a consume sampler", table), exc)
                return
