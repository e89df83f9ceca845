"""A data directory's lock and its disk's room: only one process may write a data directory, and
an operator's alerts read how much its disk holds (environment/__init__.py says how the lock holds)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from ...schema.errors import StoreError


def lock(data: Path, shared: bool) -> int:
    """An open descriptor of `data` (created empty when absent, which LMDB takes as a new
    environment) holding a flock: exclusive for a server, shared for a reader."""
    try:
        fd = os.open(data, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"cannot open {data}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(f"another expbuf process is using {data.parent}") from None
    return fd


def disk_usage(path: Path) -> tuple[int, int]:
    """The size and free bytes of the data directory's disk; -1 each where they cannot be read."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return -1, -1
    return usage.total, usage.free


def free_bytes(path: Path) -> int:
    """The free bytes of the data directory's disk (-1: unknown), for a failed write's refusal."""
    return disk_usage(path)[1]
