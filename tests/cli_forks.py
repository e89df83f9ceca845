"""`expbuf ARGS` as the tests run it: each command in a process of its own, forked from a parent that
has imported the command line and the store and done nothing else (no channel, no thread, no open
table), so that what a fork inherits is what a fresh interpreter would have built. A fresh
interpreter took 0.36 s of CPU a command, its imports, and a fork 0.03 s; the suite runs some
hundreds of commands. Each child is a real process: its own exit status, stdout and stderr (the
parent's stdin closed to it), the caller's environment and working directory.

One parent a pytest process and interpreter environment (the PYTHON* and EXPBUF_PURE_PYTHON
variables, which decide what an import loads), started at its first command; it ends with that
process. Run as a script, this module is that parent.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from forks import forked

CLI = "expbuf.server.cli"
# What decides what the parent's imports loaded: a command given other values of these runs under another parent.
IMPORT_VARIABLES = ("PYTHON", "EXPBUF_PURE_PYTHON")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`expbuf ARGS` in a forked child, as subprocess.run(..., capture_output=True, text=True) gives it:
    the child's environment is this process's with `env` set over it, and past `timeout` the child
    is killed and subprocess.TimeoutExpired raised."""
    env = {**os.environ, **(env or {})}
    request = {"args": list(args), "env": env, "cwd": os.getcwd(), "timeout": timeout}
    reply = _parent(env).ask(request)
    command = [sys.executable, "-m", CLI, *args]
    if reply["returncode"] is None:
        raise subprocess.TimeoutExpired(command, timeout, reply["stdout"], reply["stderr"])
    return subprocess.CompletedProcess(command, reply["returncode"], reply["stdout"], reply["stderr"])


class _Parent:
    """The parent process and the pipe to it; one command at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def ask(self, request: dict[str, object]) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the parent of the forked commands exited ({self.proc.wait(10)})")
        reply: dict[str, object] = json.loads(line)
        return reply

    def end(self) -> None:
        """Close its pipes: at the end of its stdin it exits."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class Alive(Protocol):
    """A parent as shared_parent keeps it: its process, to tell whether it still runs, and `end`,
    which tells it to exit (this process's end: see _end_parents)."""

    proc: subprocess.Popen[str]

    def end(self) -> None: ...


P = TypeVar("P", bound=Alive)
_parents: dict[tuple[object, ...], Alive] = {}
_parents_lock = threading.Lock()


def shared_parent(kind: Callable[[dict[str, str]], P], env: dict[str, str]) -> P:
    """This process's parent of `kind` for `env`'s import variables, started where none runs."""
    key = (kind, *sorted((name, value) for name, value in env.items() if name.startswith(IMPORT_VARIABLES)))
    with _parents_lock:
        if key not in _parents or _parents[key].proc.poll() is not None:
            _parents[key] = kind(env)
        parent = _parents[key]
    assert isinstance(parent, kind)
    return parent


@atexit.register
def _end_parents() -> None:
    """Each parent told to exit and waited for as this process ends, so that it is not left to
    run on, nor its pipes to the collector (Python warns of both)."""
    for parent in _parents.values():
        parent.end()
        try:
            parent.proc.wait(10)
        except subprocess.TimeoutExpired:
            parent.proc.kill()
            parent.proc.wait(10)


def _parent(env: dict[str, str]) -> _Parent:
    return shared_parent(_Parent, env)


def prepare() -> None:
    """Import what every command imports, once, and nothing else (no channel, thread or table)."""
    import expbuf.server
    import expbuf.server.cli
    import expbuf.server.store

    # The module itself is run afresh as __main__ in each child, as `python -m` runs it.
    del sys.modules[CLI], expbuf.server.cli


def _serve() -> None:
    """The parent: one JSON request a line on stdin, one JSON reply a line on stdout."""
    prepare()
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(forked(functools.partial(_command, request), request["timeout"])), flush=True)


def enter(request: dict) -> None:
    """Make this forked child what `python -m expbuf.server.cli ARGS` starts with: stdin closed
    to it, the request's environment, working directory and arguments."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [CLI, *request["args"]]


def _command(request: dict) -> int:
    """The child: the command run as `python -m expbuf.server.cli ARGS` runs it; its exit status."""
    enter(request)
    try:
        runpy.run_module(CLI, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            return exc.code
        if exc.code is not None:
            print(exc.code, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    _serve()
