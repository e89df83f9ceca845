"""A function run in a child forked from this process, its output caught: for checks that each need
a process of their own after the same costly imports (tests/import_adapter.py, tests/cli_forks.py),
made once in the parent rather than again by a fresh interpreter for each."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable


def forked(body: Callable[[], int], timeout: float | None = None) -> dict[str, object]:
    """`body` run in a forked child, its stdout and stderr to files of its own: the child's exit
    status (`body`'s value; 1 with the traceback printed where it raised; None where it ran past
    `timeout` and was killed) and what it printed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                code = body()
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = _wait(pid, timeout)
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read(), "stderr": err.read()}


def _wait(pid: int, timeout: float | None) -> int | None:
    """The child's exit status, as subprocess gives it; None, the child killed, past `timeout`."""
    if timeout is None:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)
