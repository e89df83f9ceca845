"""`expbuf serve` children as tests/helpers.py's ServerProcess starts them: each forked from a parent
that has imported the command line and the store and done nothing else (tests/cli_forks.py's
prepare), rather than a fresh interpreter, which spent 0.25-0.35 s of CPU a start in imports; the
suite starts some hundreds of servers. This parent has imported the server's app as well.

Unlike a command, a server runs on while its test signals it, reads its log line by line and waits
for it, so the parent does not wait for it: for each server it forks a keeper, which forks the
server, tells the test its pid, waits for it and hands the test its exit status over a socket of
their own. The test sees a Popen (ForkedServer): the server's pid to signal (its process group
with `own_group`), poll, wait, returncode, and its stderr live through a pipe whose write end
the test hands the parent (SCM_RIGHTS) with its stdout. The server ends as `python -m` ends: its
exit code, or a traceback, and the interpreter's exit (its threads joined, atexit run).

One parent a pytest process and interpreter environment, as cli_forks has; run as a script, this
module is that parent.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading

from cli_forks import CLI, enter, prepare, shared_parent

# The most a request's JSON (its arguments and environment) may take.
REQUEST_BYTES = 1 << 20


class ForkedServer:
    """An `expbuf serve` child forked by the parent, as much of subprocess.Popen as the tests use."""

    def __init__(self, args: list[str], env: dict[str, str], own_group: bool) -> None:
        self.args = [sys.executable, "-m", CLI, *args]
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._status, theirs = socket.socketpair()
        read, write = os.pipe()
        request = {"args": args, "env": env, "cwd": os.getcwd(), "own_group": own_group}
        try:
            shared_parent(_Parent, env).send(request, [theirs.fileno(), write, 1])
        finally:
            theirs.close()
            os.close(write)
        self.stderr = open(read)  # noqa: SIM115 (read to its end by the caller, as Popen's)
        said = self._read()
        if not said:
            raise RuntimeError("the parent of the forked servers did not start the server")
        self.pid = int(said)

    def _read(self) -> str:
        """What the keeper sent up to its next newline, or up to its end."""
        said = b""
        while not said.endswith(b"\n") and (part := self._status.recv(1)):
            said += part
        return said.decode()

    def _collect(self, timeout: float | None) -> None:
        """The exit status, once the keeper sends it (within `timeout`); the caller holds the lock."""
        if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
            said = self._read()
            if not said:
                raise RuntimeError(f"the keeper of server {self.pid} ended without its exit status")
            self.returncode = int(said)
            self._status.close()

    def poll(self) -> int | None:
        if self._lock.acquire(blocking=False):
            try:
                self._collect(0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            self._collect(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing once the server's exit is known (its pid may be another's since), nor
        where it has exited and its keeper has reaped it but not yet said so (no such process)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Parent:
    """The parent process and the socket to it; a request and its file descriptors a message."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lock = threading.Lock()
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            env=env,
            text=True,
        )
        theirs.close()

    def send(self, request: dict[str, object], fds: list[int]) -> None:
        with self.lock:
            socket.send_fds(self.channel, [json.dumps(request).encode()], fds)

    def end(self) -> None:
        """Close the socket to it: at its end it exits (its servers run on until their tests end them)."""
        with self.lock:
            self.channel.close()


def _serve(channel: socket.socket) -> None:
    """The parent: a keeper forked for each request, reaped by the kernel (SIGCHLD ignored); it
    returns in a server, whose interpreter then ends as `python -m`'s."""
    prepare()
    importlib.import_module("expbuf.server.app")  # what a start imports besides: 0.14 s of CPU more
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        message, fds, _, _ = socket.recv_fds(channel, REQUEST_BYTES, 3)
        if not message:
            return
        request = json.loads(message)
        if os.fork() == 0:
            channel.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _keep(request, *fds)
            _run(request, *fds)
            return
        for fd in fds:
            os.close(fd)


def _keep(request: dict, status: int, stderr: int, stdout: int) -> None:
    """The keeper: fork the server (returning in it), send the test its pid and then its exit
    status, and exit."""
    pid = os.fork()
    if pid == 0:
        return
    try:
        if request["own_group"]:
            with contextlib.suppress(ProcessLookupError):  # as the server does: the group is there whichever runs first
                os.setpgid(pid, pid)
        for fd in (stderr, stdout):
            os.close(fd)
        with socket.socket(fileno=status) as test:
            test.sendall(f"{pid}\n".encode())
            test.sendall(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n".encode())
    finally:
        os._exit(0)


def _run(request: dict, status: int, stderr: int, stdout: int) -> None:
    """The server: `python -m expbuf.server.cli ARGS` from here on, to the interpreter's exit."""
    os.close(status)
    if request["own_group"]:
        os.setpgid(0, 0)
    os.dup2(stderr, 2)
    os.dup2(stdout, 1)
    os.close(stderr)
    os.close(stdout)
    enter(request)
    runpy.run_module(CLI, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
