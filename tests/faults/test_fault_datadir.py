"""The data directory under operators' mistakes: a lock file deleted under a running server."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from pathlib import Path

import pytest

from expbuf.proto.v1 import buffer_pb2 as pb

from faultkit import channel, payload, servers, stats, stub

pytestmark = pytest.mark.faults


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`expbuf ARGS` in a child process; a server that starts when it should not times out here."""
    return subprocess.run(
        [sys.executable, "-m", "expbuf.server.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2 and one line on stderr, with no traceback, holding every word."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_deleting_the_lock_files_lets_no_second_server_in(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with servers() as start:
        first = start(str(data))
        chan = channel(first.target)
        buffer = stub(chan)
        for task in range(2):
            buffer.Push(pb.PushRequest(table="default", payload=payload("0", task)[0]), timeout=30)
        # A consume batch sent and not yet confirmed: held for the stream until it confirms.
        requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        requests.put(pb.SampleRequest(table="default", num_groups=1, max_batches=2))
        call = buffer.Sample(iter(requests.get, None), timeout=60)
        held = next(call)
        assert stats(buffer).leased == 4

        for name in ("expbuf.lock", "lock.mdb"):  # whatever files a careless cleanup removes
            (data / name).unlink(missing_ok=True)
        done = cli("serve", "--data", str(data), "--port", "0", "--metrics-port", "-1")
        one_line_error(done, str(data), "another expbuf process")

        assert first.proc.poll() is None
        assert stats(buffer).leased == 4  # the second start did not release the first one's hold
        requests.put(pb.SampleRequest(received=1))  # the held batch is confirmed: consumed now
        second = next(call)
        assert not set(held.uids) & set(second.uids)
        requests.put(pb.SampleRequest(received=2))
        requests.put(None)
        assert list(call) == []
        after = stats(buffer)
        assert (after.consumed, after.leased, after.ready) == (8, 0, 0)
        chan.close()
    assert os.path.exists(data / "data.mdb")
