"""A stop signal sent to the server's whole process group, as GNU `timeout`, systemd's default
`KillMode=control-group`, supervisord's `killasgroup`, `kill -TERM -PGID` and a terminal's Ctrl-C
send it: the ingest processes take it too, and leave the stop to the server. The server exits 0,
keeps every push it acknowledged, and logs no traceback and no error."""

from __future__ import annotations

import copy
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.rpc.push import ingest

from helpers import ServerProcess, group_items

INGEST = ("--ingest-processes", "2")
PUSHERS = 4  # more pushes at once than ingest processes: both stay busy
# Experiences in a push, of 2 KB each: above ingest.SMALL, so a push is handed to a process. A process
# takes a push only while another is decoded: with 128 a push (2 ms of decode) pushes rarely overlapped,
# and the first test waited 70-110 s on a loaded machine for its processes' CPU, through 4,000-7,000
# pushes, then read each back; with 512, 20 s and 170 pushes.
RUNS = 512
TEMPLATE = group_items("template", 0, RUNS, response=400)


def push_of(name: str) -> tuple[bytes, list[str]]:
    """A push of RUNS experiences of their own (batch `name`), and their uids."""
    items = []
    for item in TEMPLATE:
        meta = copy.deepcopy(item.meta)
        meta["eid"]["batch"] = name
        items.append(trxp.RawItem(meta, item.tensors))
    return trxp.build(items), [item.uid for item in items]


def ingest_processes(server: int) -> list[int]:
    """The pids of the server's ingest processes started so far (its children running
    ingest_worker.py)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == server and b"ingest_worker" in command:
            found.append(int(entry.name))
    return found


def cpu_ticks(pid: int) -> int:
    """The CPU time a process has used, in clock ticks (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def clean(log: str) -> None:
    """The log of a clean stop: the server said it stopped, and nothing died or failed."""
    assert "expbuf stopped" in log, log
    for word in ("Traceback", "KeyboardInterrupt", " ERROR ", "ingest process died", "ingest process failed"):
        assert word not in log, log


class Pushers:
    """PUSHERS threads pushing one push after another into `table` until the server stops
    answering; every push sent, with whether the server acknowledged it."""

    def __init__(self, target: str, table: str) -> None:
        self.sent: list[tuple[list[str], bool]] = []
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(target)
        stub = pb_grpc.ExperienceBufferStub(self._channel)
        self._threads = [
            threading.Thread(target=self._push, args=(stub, table, number), daemon=True) for number in range(PUSHERS)
        ]
        for thread in self._threads:
            thread.start()

    def _push(self, stub: pb_grpc.ExperienceBufferStub, table: str, number: int) -> None:
        for count in range(10_000):
            data, uids = push_of(f"p{number}-{count}")
            try:
                stub.Push(pb.PushRequest(table=table, payload=data), timeout=60)
            except grpc.RpcError:
                with self._lock:
                    self.sent.append((uids, False))
                return
            with self._lock:
                self.sent.append((uids, True))

    def acknowledged(self) -> int:
        with self._lock:
            return sum(done for _, done in self.sent)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(60)
            assert not thread.is_alive(), "a pusher is still pushing after the stop"
        self._channel.close()


def test_sigterm_to_the_group_with_pushes_in_flight_keeps_what_was_acknowledged(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    server = ServerProcess(data, *INGEST, own_group=True)
    try:
        with BufferClient(server.target) as client:
            client.create_table("t", group_by="none", estimator="none")
        assert len(push_of("size")[0]) > ingest.SMALL
        assert ingest_processes(server.proc.pid) == [], "".join(server.log)  # none until pushes overlap
        pushers = Pushers(server.target, "t")  # they overlap: the server starts its ingest processes
        seen: dict[int, int] = {}  # each worker's CPU when first seen (it is importing then, or has)
        deadline = time.monotonic() + 120
        while len(seen) < 2 or any(cpu_ticks(pid) < ticks + 40 for pid, ticks in seen.items()):
            assert time.monotonic() < deadline, "the ingest processes decoded nothing:\n" + "".join(server.log)
            for pid in ingest_processes(server.proc.pid):
                seen.setdefault(pid, cpu_ticks(pid))
            time.sleep(0.05)
        assert pushers.acknowledged() >= PUSHERS, "".join(server.log)
        code = server.stop(signal.SIGTERM, group=True)  # pushes are in flight, in the ingest processes
        pushers.join()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = "".join(server.log)
    assert code == 0, log
    clean(log)
    again = ServerProcess(data, warm=False)
    try:
        with BufferClient(again.target) as client:
            for uids, acknowledged in pushers.sent:
                missing = client.get(uids, table="t").missing_uids
                assert missing == [] if acknowledged else missing in ([], uids), (acknowledged, missing)
            assert client.stats("t")["t"].pushed == sum(len(uids) for uids, done in pushers.sent if done)
    finally:
        assert again.stop(signal.SIGTERM) == 0, "".join(again.log)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_group_signal_while_the_ingest_processes_start_stops_the_server_cleanly(tmp_path: Path, sig: int) -> None:
    """The signal reaches the ingest processes as they import what they run (the first pushes that
    overlap start them): the server stops, with no traceback."""
    server = ServerProcess(str(tmp_path / "data"), *INGEST, own_group=True)
    try:
        with BufferClient(server.target) as client:
            client.create_table("t", group_by="none", estimator="none")
        pushers = Pushers(server.target, "t")
        deadline = time.monotonic() + 60
        while not ingest_processes(server.proc.pid):
            assert server.proc.poll() is None and time.monotonic() < deadline, "".join(server.log)
            time.sleep(0.001)
        code = server.stop(sig, group=True)
        pushers.join()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)
    log = "".join(server.log)
    assert code == 0, log
    clean(log)
