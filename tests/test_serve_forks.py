"""The `expbuf serve` children the tests start (helpers.ServerProcess) behave the same forked from
the prepared parent (tests/serve_forks.py) as started fresh: their pid and process group to signal,
poll, wait and their exit status as subprocess gives them, their log read live, and a start that
fails failing its test at once with that log."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from expbuf.client import BufferClient, UnavailableError

from helpers import ServerProcess


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_server_is_signalled_and_waited_for_as_a_child(tmp_path: Path, fresh: bool) -> None:
    server = ServerProcess(str(tmp_path / "data"), own_group=True, fresh=fresh)
    try:
        assert os.getpgid(server.proc.pid) == server.proc.pid
        assert server.proc.poll() is None and server.proc.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            server.proc.wait(0.05)
        os.kill(server.proc.pid, signal.SIGSTOP)
        os.kill(server.proc.pid, signal.SIGCONT)
        with BufferClient(server.target) as client:
            client.create_table("t")
        assert server.proc.poll() is None, "".join(server.log)
        assert server.stop(signal.SIGINT, group=True) == 0, "".join(server.log)
        assert "expbuf stopped" in "".join(server.log)
        assert server.proc.poll() == 0 and server.proc.returncode == 0
        server.proc.kill()  # nothing: the child's pid is no longer its own
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    again = ServerProcess(str(tmp_path / "data"), fresh=fresh)
    again.proc.kill()
    assert again.proc.wait(30) == -signal.SIGKILL
    with BufferClient(again.target, timeout=5) as client, pytest.raises(UnavailableError):
        client.list_tables()


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_server_that_does_not_start_fails_with_its_log(tmp_path: Path, fresh: bool) -> None:
    with pytest.raises(AssertionError, match=r"(?s)server did not start \(exit code 2\).*--metrics-port"):
        ServerProcess(str(tmp_path / "data"), "--metrics-port", "x", fresh=fresh)
