"""The last room of the map and of the disk, kept for the writes that make room.

LMDB writes every page a transaction changes to a free page (copy on write), so a consume, an ack
or a delete needs free pages as a push does: a store filled to its last page refused every write
for good, the consumes that would have emptied it included. So pushes (the writer's `grows`
requests) stop `reserve` bytes short of the end: the map they run under is held `reserve` below
its bound (the writer's `ceiling`), and a batch they fill runs again without them, the map let
into the reserve for its other requests (`limit`).

The disk's end is not the map's: a full disk fails a commit's page writes, wherever the map's bound
is. On a disk whose free bytes run low (under LOW_DISK reserves), the data file is extended ahead
of its last page by two to three reserves (posix_fallocate): those pages are the file's own when
the disk fills, and once the disk gives no more (`tight`), pushes run under the file's end less
the reserve and the rest runs under the file's end. A look at the disk costs a syscall once the map
has grown a quarter of a reserve since the last; a disk with room is never written ahead.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import lmdb

from .directory import disk_usage, free_bytes

log = logging.getLogger("expbuf.store")
# The bytes kept for what makes room, at most: enough for a consume of the largest take (65,536
# experiences: their tombstones and the pages their deletes change).
RESERVE = 32 << 20
# The data file is written ahead of its last page once the disk's free bytes are below this many reserves.
LOW_DISK = 16
# What posix_fallocate fails with where the disk (or the process's share of it) is full.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class Room:
    """How far a data directory's pushes, and its other writes, may take the map: its bound less a
    reserve, and the disk's end where the disk is full."""

    def __init__(self, env: lmdb.Environment, path: Path, fd: int, max_map_size: int) -> None:
        self.env, self.path, self._fd = env, path, fd
        self.max_map_size = max_map_size
        self._psize = env.stat()["psize"]
        disk = disk_usage(path)[0]
        # RESERVE, or less where the map's bound or the disk is small (an eighth, a sixteenth of it)
        self.reserve = min(RESERVE, max_map_size // 8, disk // 16 if disk > 0 else RESERVE)
        self.ahead = 0  # where the data file was written ahead to (posix_fallocate); 0: not written ahead
        self.tight = False  # the disk gave no more: the file's end bounds the map
        self._look_at = 0  # the map's use at which the disk is looked at next
        self._can_write_ahead = True  # False on a file system without posix_fallocate

    def used(self, last_pgno: int | None = None) -> int:
        """The bytes of the map up to its last page in use (LMDB's last_pgno, read now where not given)."""
        return ((self.env.info()["last_pgno"] if last_pgno is None else last_pgno) + 1) * self._psize

    def limit(self, used: int) -> int:
        """How far the map may grow for what makes room: max_map_size, or the file's end where the disk is full."""
        return min(self.max_map_size, max(self.ahead, used)) if self.tight else self.max_map_size

    def ceiling(self, used: int) -> int:
        """How far the map may grow for pushes: `limit` less the reserve (never below what is in use)."""
        return max(self.limit(used) - self.reserve, used)

    def after_commit(self, used: int) -> None:
        """Look at the disk once the map's use has grown a quarter of a reserve since the last look,
        and write the file ahead where the disk runs low."""
        if used < self._look_at:
            return
        self._look_at = used + self.reserve // 4
        if self.tight or free_bytes(self.path) < LOW_DISK * self.reserve:
            self.write_ahead(used)

    def write_ahead(self, used: int) -> bool:
        """Extend the data file to three reserves past its last page in use (once it is less than two
        ahead); False where the disk had no room for it, which makes the store `tight`."""
        reserve = self.reserve
        if not self._can_write_ahead or self.ahead >= used + 2 * reserve:
            return not self.tight
        try:
            os.posix_fallocate(self._fd, used, 3 * reserve)
        except OSError as exc:
            if exc.errno not in _FULL:
                self._can_write_ahead = False
                log.warning(
                    "the data file of %s cannot be written ahead (%s): a full disk may stop consumes",
                    self.path,
                    exc,
                )
                return True
            if not self.tight:
                log.error(
                    "the disk of %s is full (%s free): pushes are refused; consumes, acks and deletes go on in the "
                    "%d bytes kept for them",
                    self.path,
                    free_bytes(self.path),
                    max(self.ahead - used, 0),
                )
            self.ahead = max(self.ahead, os.fstat(self._fd).st_size)
            self.tight = True
            return False
        if self.tight:
            log.warning("the disk of %s has room again: pushes are taken", self.path)
        self.ahead, self.tight = used + 3 * reserve, False
        return True
