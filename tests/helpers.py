"""Builders of experiences for tests and benchmarks."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from expbuf.client import EID, Experience, trxp
from expbuf.client.schema.experience import TENSOR_FIELDS
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.store import Entry, Sampled, Store
from expbuf.server.store.core.table_state.pending_reads import pending_rows
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.disk.rows import (
    Member,
    PendingHead,
    SegmentView,
    SegState,
    directory_entry,
)
from expbuf.server.store.schema.estimator_registry import Estimator, register, unregister
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import COMPUTING, PENDING, State
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
import serve_forks

# batch.tensordict() needs the tensordict package, which expbuf does not require: a machine
# without it (a user's bare GPU host) skips what reads batches as TensorDicts, and runs the rest.
needs_tensordict = pytest.mark.skipif(
    importlib.util.find_spec("tensordict") is None, reason="tensordict is not installed (pip install tensordict)"
)

if TYPE_CHECKING:
    from expbuf.client import BufferClient, TableStats


def make_experience(
    batch: int | str,
    task: int | str,
    run: int,
    *,
    step: int = 0,
    reward: float | None = 1.0,
    response: int = 4,
    prompt: int = 3,
    version: int | None = 1,
    priority: float | None = None,
) -> Experience:
    info: dict = {} if version is None else {"model_version": version}
    if priority is not None:
        info["priority"] = priority
    return Experience(
        eid=EID(batch=batch, task=task, run=run, step=step, suffix=f"r{run}s{step}"),
        tokens=torch.arange(prompt + response, dtype=torch.int32),
        prompt_length=prompt,
        logprobs=torch.full((response,), -0.5),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=reward,
        info=info,
    )


def group_items(batch: int | str, task: int | str, size: int, **kwargs: object) -> list[trxp.RawItem]:
    """A GRPO group: `size` runs of one task, as validated RawItems."""
    return [trxp.from_experience(make_experience(batch, task, run, **kwargs)) for run in range(size)]


SMALL = trxp.from_experience(Experience(eid=EID(batch=0, task=0, run=0), tokens=list(range(8)), prompt_length=4))


def small_groups(first: int, count: int) -> list[Entry]:
    """Experiences of tasks first..first+count-1 of batch 0, each its own group (no priority, no
    version), from one template: cheaply enough for a million."""
    made = []
    for task in range(first, first + count):
        meta = {**SMALL.meta, "eid": {**SMALL.meta["eid"], "task": task}}
        made.append(Entry.of(trxp.RawItem(meta, SMALL.tensors)))
    return made


def wait_for(check: Callable[[], object], what: str, seconds: float = 120.0) -> None:
    """Poll until `check()` holds; fail naming `what` after `seconds` (a generous bound: the
    machine is shared and slow at times)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.02)


def pythonpath(*folders: str | os.PathLike[str]) -> str:
    """A child's PYTHONPATH: `folders` first, then this process's own, never replaced (expbuf
    itself may be found through it, as where it is laid out on PYTHONPATH, not installed)."""
    return os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])


def wait_ready(client: BufferClient, table: str, experiences: int) -> None:
    """Wait until `experiences` of `table` are ready: a push returns before its groups' advantages
    are computed where the worker computes them (on CUDA, say), not the push."""
    wait_for(lambda: client.stats(table)[table].ready >= experiences, f"{experiences} ready in table {table}")


def fill(client: BufferClient, groups: int, table: str = "t") -> None:
    """Push `groups` complete groups of two (tasks 0..groups-1 of batch 1) into `table`."""
    items = [item for task in range(groups) for item in group_items(1, task, 2)]
    for start in range(0, len(items), 200):
        client.push(trxp.build(items[start : start + 200]), table=table)


def settle(client: BufferClient, predicate: Callable[[TableStats], bool], table: str = "t") -> TableStats:
    """The table's stats once `predicate(stats)` holds, or after 10 s (the server finishes a
    broken stream on its own)."""
    deadline = time.monotonic() + 10
    while True:
        stats = client.stats(table)[table]
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class Conversation:
    """A raw client of the Sample stream (as one in another language would be) that confirms
    each batch when told to."""

    def __init__(self, stub: pb_grpc.ExperienceBufferStub, first: pb.SampleRequest, timeout: float = 30) -> None:
        self._out: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        self._out.put(first)
        self.call = stub.Sample(iter(self._out.get, None), timeout=timeout)

    def read(self) -> pb.SampleReply:
        return next(self.call)

    def confirm(self, received: int, *, stop: bool = False) -> None:
        self._out.put(pb.SampleRequest(received=received, stop=stop))

    def cancel(self) -> None:
        self.call.cancel()
        self._out.put(None)

    def end(self) -> grpc.RpcError:
        """The error that ends the stream, once every reply before it was read."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError as error:
            return error
        finally:
            self._out.put(None)
        raise AssertionError("the stream ended without an error")


@contextlib.contextmanager
def serving(
    servicer: pb_grpc.ExperienceBufferServicer, interceptors: Sequence[grpc.ServerInterceptor] = ()
) -> Iterator[str]:
    """A servicer of the test's own (one that misbehaves on purpose) on a free loopback port; its target."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    pb_grpc.add_ExperienceBufferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


class Decodes:
    """The client's decode (trxp.decode_reply, what Batch.experiences runs), wrapped, never
    replaced: each decode started is counted with the name of its thread, and `hold` makes one
    wait for a release the test gives. `install` sets it in place (pytest's monkeypatch.setattr,
    or the builtin setattr in a child process)."""

    def __init__(self, install: Callable[[object, str, object], None]) -> None:
        self.threads: list[str] = []
        self.held: dict[int, tuple[threading.Event, threading.Event]] = {}
        self.released: dict[int, bool] = {}
        self._changed = threading.Condition()
        real = trxp.decode_reply

        def decode(payload: bytes) -> list[Experience]:
            with self._changed:
                self.threads.append(threading.current_thread().name)
                number = len(self.threads)
                self._changed.notify_all()
            if number in self.held:
                started, release = self.held[number]
                started.set()
                self.released[number] = release.wait(10)
            return real(payload)

        install(trxp, "decode_reply", decode)

    def wait(self, count: int, seconds: float = 10.0) -> bool:
        """Whether `count` decodes have started within `seconds`."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.threads) >= count, seconds)

    def hold(self, number: int) -> tuple[threading.Event, threading.Event]:
        """Decode `number` sets the first event when it starts and waits for the second."""
        self.held[number] = (threading.Event(), threading.Event())
        return self.held[number]


def take(store: Store, table: str, **spec: object) -> Sampled | None:
    """One batch straight from the store (consumed unless the spec says otherwise)."""
    return store.sample(TakeSpec(table, **spec))


@contextlib.contextmanager
def passes_started(inside: str = "", thread: int | None = None) -> Iterator[list[bool]]:
    """For each garbage collector pass that starts in the block (only those `thread` brings on, if
    given: a pass runs on the thread whose allocation brought it on), whether that thread was inside
    a function named `inside`; with the collector running and its first threshold low, so that work
    a pause did not cover would bring on many."""
    started: list[bool] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and thread in (None, threading.get_ident()):
            frame, found = sys._getframe(1), False
            while frame is not None and inside and not found:
                found = frame.f_code.co_name == inside
                frame = frame.f_back
            started.append(found)

    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(100, 10, 10)
    gc.enable()
    gc.callbacks.append(seen)
    try:
        yield started
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


@contextlib.contextmanager
def registered(estimator: Estimator) -> Iterator[str]:
    """An estimator registered for the length of a test; yields its name."""
    register(estimator)
    try:
        yield estimator.name
    finally:
        unregister(estimator.name)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def raw_sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(trxp.raw_of(tensor).data).hexdigest()


def check_against_manifest(exp: Experience, want: dict) -> None:
    """An experience equals its manifest entry: ids, values, tensor dtypes, shapes, sha256."""
    assert exp.eid.uid == want["uid"]
    assert (exp.eid.tid, exp.eid.rid, exp.eid.sid) == (want["tid"], want["rid"], want["sid"])
    assert exp.eid.to_dict() == want["eid"]
    for name in (
        "reward",
        "prompt_length",
        "info",
        "metrics",
        "truncate_status",
        "prompt_text",
        "response_text",
        "messages",
        "tools",
        "chosen_messages",
        "rejected_messages",
        "custom_fields",
    ):
        assert getattr(exp, name) == want[name], name
    present = {name: getattr(exp, name) for name in TENSOR_FIELDS if getattr(exp, name) is not None}
    assert set(present) == set(want["tensors"])
    for name, spec in want["tensors"].items():
        tensor = present[name]
        assert str(tensor.dtype) == f"torch.{spec['dtype']}", name
        assert list(tensor.shape) == spec["shape"], name
        assert raw_sha(tensor) == spec["sha256"], name
    assert set(exp.multi_modal_inputs) == set(want["multi_modal_inputs"])
    for key, spec in want["multi_modal_inputs"].items():
        tensor = exp.multi_modal_inputs[key]
        assert str(tensor.dtype) == f"torch.{spec['dtype']}"
        assert list(tensor.shape) == spec["shape"]
        assert raw_sha(tensor) == spec["sha256"]


def hold_port(port: int = 0) -> socket.socket:
    """`port` (0: a free one) bound without listening, so that nothing else on the machine binds
    it: a server stopped to be started again on its port keeps it so, where another test's server,
    started meanwhile on a free port, would take it and answer the first one's clients. A server
    binds it all the same (gRPC's bind, as this one, allows an address bound by a socket that does
    not listen)."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT allowed
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


# The ports of `expbuf serve` children that exited (ServerProcess), each held from the moment its
# child's log ended until a child is started on it again or the test ends (release_held_ports).
_held_ports: dict[int, socket.socket] = {}
_held_lock = threading.Lock()


def release_held_ports() -> None:
    """Let go the ports of the children that exited (a test's end)."""
    with _held_lock:
        while _held_ports:
            _held_ports.popitem()[1].close()


class Beside(threading.Thread):
    """A test's step run beside its main one, after `delay` seconds (a server restarted while a
    call waits); join() raises what the step raised, which a plain thread only prints while the
    main step waits out its timeout for what the failed step never did."""

    def __init__(self, step: Callable[[], object], delay: float = 0.0) -> None:
        super().__init__(daemon=True)
        self._step, self._delay = step, delay
        self.error: BaseException | None = None

    def run(self) -> None:
        time.sleep(self._delay)
        try:
            self._step()
        except BaseException as exc:  # handed to join's caller
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise AssertionError(f"the step beside the test's own failed: {self.error!r}") from self.error


class ServerProcess:
    """`expbuf serve` in a child process, for restart and kill tests.

    Every port is a free one: gRPC and metrics on port 0 unless `args` say otherwise, both
    read back from the start-up line. Once the child exits its gRPC port is held (hold_port) until
    a child is started on it again (`--port`) or the test ends, so that a server killed and started
    again on its port is the one its clients reach. With `own_group` it leads a process group of its own (with
    the ingest processes it starts), as a shell's job does. A child that exits before it listens fails at once,
    with its log. With `warm` (the default) the child is returned once its advantage worker
    has started, or failed to, or is not needed yet, as its log says: torch loads after the
    server listens, where a table needs it (server/advantages/start.py), and a test that measures
    the child's memory or CPU, or a push's latency, must not count that load. A benchmark of the
    start itself passes warm=False.

    The child is forked from a parent that has imported the server (tests/serve_forks.py), unless
    `fresh`: a new interpreter, for a test that measures the child's memory or CPU, which a fork
    shares with its parent or skips; so too where `env` sets PYTHONPATH, a test's own folder,
    for which a parent would be started to fork this one child.
    """

    def __init__(
        self,
        data: str,
        *args: str,
        env: dict[str, str] | None = None,
        start_seconds: float = 60,
        warm: bool = True,
        own_group: bool = False,
        fresh: bool = False,
    ) -> None:
        defaults = [] if "--metrics-port" in args else ["--metrics-port", "0"]
        with _held_lock:  # let go once the child listens on it, or exited
            held = _held_ports.pop(int(args[args.index("--port") + 1]), None) if "--port" in args else None
        argv = ["serve", "--data", data, "--port", "0", *defaults, *args]
        environment = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | serve_forks.ForkedServer
        if fresh or "PYTHONPATH" in (env or {}):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "expbuf.server.cli", *argv],
                stderr=subprocess.PIPE,
                text=True,
                env=environment,
                process_group=0 if own_group else None,  # own_group: a terminal's job, for its Ctrl-C
            )
        else:
            self.proc = serve_forks.ForkedServer(argv, environment, own_group)
        self.log: list[str] = []
        self.port = 0
        self.metrics_port = -1
        ready, self._warm = threading.Event(), threading.Event()
        self._reader = threading.Thread(target=self._read, args=(ready,), daemon=True)
        self._reader.start()
        started = ready.wait(start_seconds)
        if held is not None:
            held.close()
        if not started or not self.port or (warm and not self._warm.wait(start_seconds)):
            self.proc.kill()
            code = self.proc.wait(10)
            raise AssertionError(f"server did not start (exit code {code}):\n" + "".join(self.log))

    def _read(self, ready: threading.Event) -> None:
        """Collect the log; `ready` is set when the server listens or its stderr closes (it exited)."""
        import re

        for line in self.proc.stderr:
            self.log.append(line)
            match = re.search(r"listening on [\w.\[\]:]+?:(\d+) \(metrics (?:[\w.\[\]:]+?:(\d+)|off)", line)
            if match:
                self.port = int(match.group(1))
                self.metrics_port = int(match.group(2) or -1)
                ready.set()
            if any(f"advantage worker {said}" in line for said in ("started", "did not start", "not needed yet")):
                self._warm.set()
        self.proc.stderr.close()  # read to its end: the server and every child of its have exited
        ready.set()
        self._warm.set()
        self._hold_port()

    def _hold_port(self) -> None:
        """Hold the port of a child that exited (hold_port); a port bound again already is left."""
        with _held_lock:
            if self.port and self.port not in _held_ports:
                with contextlib.suppress(OSError):
                    _held_ports[self.port] = hold_port(self.port)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int, *, group: bool = False) -> int:
        """Send `sig` (to its whole process group with `group`, as a terminal's Ctrl-C does: see
        `own_group`); the exit code, once the child's log is read to its end."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        code = self.proc.wait(30)
        self._hold_port()
        self._reader.join(30)
        return code


@contextlib.contextmanager
def servers() -> Iterator[Callable[..., ServerProcess]]:
    """Start `expbuf serve` children on free ports (ServerProcess: gRPC and metrics on port 0,
    read back), `env` EXPBUF_* settings of their own; SIGKILL those still running on the way out."""
    started: list[ServerProcess] = []

    def start(data: str, *args: str, env: dict[str, str] | None = None, fresh: bool = False) -> ServerProcess:
        server = ServerProcess(data, *args, env=env, fresh=fresh)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGKILL)
                server.proc.wait(30)


class StoppedClock:
    """A store's clock that moves only when a test sets `now`."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def layouts_reply(batch: Sampled | None) -> tuple[object, ...] | None:
    """What a client is sent of a batch: the same from a records and a rows table of one data."""
    if batch is None:
        return None
    return (
        batch.uids, batch.group_ids, batch.payload, batch.versions, batch.rewards, batch.response_lengths,
        batch.times_sampled, batch.partial, batch.masked,
    )  # fmt: skip


def layouts_stats(store: Store, table: str) -> dict[str, object]:
    """A table's stats, to compare a records and a rows table's, but its oldest group's age and
    `next_rseq`: a rows table's group dropped while pending takes places in that order too (its
    segment's id), where a records table's takes none."""
    return {k: v for k, v in store.stats(table).items() if k not in ("oldest_age_seconds", "next_rseq")}


def take_both(store: Store, name: str, **spec: object) -> tuple[object, ...] | None:
    """The same take from tables `name` and `name`_rows (both_layouts); the rows table's reply,
    asserted equal to the records one's."""
    got = [
        layouts_reply(store.sample(TakeSpec(table=table, wait_seconds=0, **spec))) for table in (name, f"{name}_rows")
    ]  # type: ignore[arg-type]
    assert got[1] == got[0]
    return got[1]


def both_layouts(store: Store, name: str, **settings: object) -> None:
    """Tables `name` (storage layout records) and `name`_rows (rows, issue 64) of the same settings."""
    made = TableConfig.of(name, **settings)  # type: ignore[arg-type]
    records = dataclasses.replace(made, storage=dataclasses.replace(made.storage, layout="records"))
    store.create_table(records)
    rows = dataclasses.replace(records.storage, layout="rows")
    store.create_table(dataclasses.replace(records, name=f"{name}_rows", storage=rows))


class StoredMember(NamedTuple):
    """A member of a rows table as its rows keep it (stored_members)."""

    member: Member  # its columns: digest, size, seq, ...
    group: str
    seg: int | None  # its segment's id; None for a member of a fragment
    state: State  # its group's: pending or computing for a member of a fragment
    retired: float | None  # when its segment's last group retired; None while one is live
    payload: bytes | None  # its value in blobs; None once its payload is gone (a tombstone's)


def stored_members(env: Environment) -> dict[bytes, StoredMember]:
    """Every member every rows table of `env` keeps, by its key (table prefix + uid, as a records
    table's item record was): each segment's members with their group's state (a deleted member left
    out) and each pending group's members from its fragments and head (every fragment of a pending
    head), each with its payload in blobs."""
    found: dict[bytes, StoredMember] = {}
    with env.read() as txn:
        for key, raw in txn.cursor(db=env.db["segs"]):
            prefix, seg, view = bytes(key[:4]), int.from_bytes(key[4:], "big"), SegmentView(raw)
            state_row = txn.get(key, db=env.db["sstate"])
            assert state_row is not None, key
            row = SegState.decode(state_row)
            for g, gkey in enumerate(view.keys(0, view.groups)):
                for i in row.kept(*view.span(g)):
                    member = view.members.members(i, i + 1)[0]
                    uid = prefix + member.uid.encode()
                    found[uid] = StoredMember(
                        member, gkey, seg, row.state(g), row.retired, txn.get(uid, db=env.db["blobs"])
                    )
        for key in txn.cursor(db=env.db["frags"]).iternext(values=False):
            prefix, gkey = bytes(key[:4]), bytes(key[4:-5]).decode()
            entry = txn.get(prefix + gkey.encode(), db=env.db["gdir"])
            assert isinstance(None if entry is None else directory_entry(entry), PendingHead), gkey  # of a pending head
        for key, raw in txn.cursor(db=env.db["gdir"]):
            head = directory_entry(raw)
            if not isinstance(head, PendingHead):
                continue
            prefix, gkey = bytes(key[:4]), bytes(key[4:]).decode()
            state = PENDING if head.queued is None else COMPUTING
            for member in pending_rows(txn, env.db, prefix, gkey, head):
                uid = prefix + member.uid.encode()
                found[uid] = StoredMember(member, gkey, None, state, None, txn.get(uid, db=env.db["blobs"]))
    return found


def killed_while_opening(data: Path, delay: float) -> None:
    """An `expbuf serve` of `data` killed with SIGKILL `delay` seconds after it took the directory's
    lock: a start cut short during its open (an upgrade of the format, say)."""
    serve = ["serve", "--data", str(data), "--port", "0", "--metrics-port", "-1"]
    child = serve_forks.ForkedServer(serve, dict(os.environ), own_group=False)
    try:
        while not (data / "lock.mdb").exists() and child.poll() is None:
            time.sleep(0.0002)
        time.sleep(delay)
    finally:
        child.kill()
        child.wait(30)
        child.stderr.close()


def checked_after_a_kill(data: Path, delay: float, format_found: int) -> list[str]:
    """`expbuf check`'s lines on `data` after a start killed `delay` seconds into its open
    (killed_while_opening), asserted clean: the directory as it found it (of `format_found`, which
    the next start upgrades), or all of it upgraded, each table's "ok"."""
    killed_while_opening(data, delay)
    checked = cli_forks.run("check", "--data", str(data), timeout=120)
    assert checked.returncode == 0 and not checked.stderr, (delay, checked.stdout, checked.stderr)
    lines = checked.stdout.splitlines()
    upgrade = (
        f"{data}: data directory format {format_found}, which the next expbuf serve upgrades to format "
        f"{layout.FORMAT}; run expbuf check after that to check its tables"
    )
    assert lines == [upgrade] or (lines and all(line.endswith(": ok") for line in lines)), (delay, lines)
    return lines


class SlowReplies:
    """A TCP proxy on a free loopback port in front of `target` that hands the server's bytes on
    `delay` seconds after they came (0 until set: gRPC's connection setup has a short bound), and
    the client's at once: a slow way back, which a status sent after a stream's replies travels
    too, as on a long link or through a busy load balancer. Between `hold()` and `release()` it hands
    on no byte either way: a server slow to answer a connection, which a call made with wait_for_ready
    waits for."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._backend = (host, int(port))
        self.delay = 0.0
        self._flowing = threading.Event()
        self._flowing.set()
        self._pending = 0  # server bytes read and not yet handed on
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="slow-replies", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self._backend)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def send() -> None:
            while True:
                due, data = held.get()
                time.sleep(max(0.0, due - time.monotonic()))
                self._flowing.wait()
                with contextlib.suppress(OSError):
                    if data:
                        sink.sendall(data)
                    else:
                        sink.shutdown(socket.SHUT_WR)
                with self._changed:
                    self._pending -= len(data) if slow else 0
                    self._changed.notify_all()
                if not data:
                    return

        threading.Thread(target=send, daemon=True).start()
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                self._pending += len(data) if slow else 0
            held.put((time.monotonic() + (self.delay if slow else 0.0), data))
            if not data:
                return

    def hold(self) -> None:
        """Hand on nothing until `release()`."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def flushed(self, timeout: float = 30) -> bool:
        """Wait until every byte the server has sent so far has reached the client."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._listener.close()


def held_writer(environment: Environment) -> tuple[threading.Event, futures.Future[object]]:
    """The writer held inside a request of its own until the event is set: what is queued meanwhile
    runs in its next batch."""
    inside, go = threading.Event(), threading.Event()
    held = environment.queue(lambda txn: (inside.set(), go.wait(60)))
    assert inside.wait(60), "the writer never ran the holding request"
    return go, held
