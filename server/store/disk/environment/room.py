"""The last room of the map and of the disk, kept for the writes that make room.

LMDB writes every page a transaction changes to a free page (copy on write), so a consume, an ack
or a delete needs free pages as a push does: a store filled to its last page refused every write
for good, the consumes that would have emptied it included. So pushes (the writer's `grows`
requests) must leave `reserve` bytes of the store's room free: a batch of them that would leave
less is run again without them (writer.py), and its other requests go on in the reserve. The room
is counted in pages in use (each database's, in the batch's own transaction), not up to LMDB's last
page: the pages consumes free below it are room again, and pushes that take them leave the reserve
as it was. Counting costs some 50 µs, so a batch counts only where the store is within NEAR
reserves of its end.

The disk's end is not the map's: a full disk fails a commit's page writes, wherever the map's bound
is. On a disk whose free bytes run low (under LOW_DISK reserves), the data file is extended ahead of
its last page by three reserves (posix_fallocate) and its end is the store's end for pushes: those
pages are the file's own when the disk fills. A push that would pass it extends the file first
where the disk still has room; where it has none (`tight`), the push is refused. A disk with room
is never written ahead; a look at it costs a syscall each quarter reserve the file grows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import lmdb

from .directory import DISK_FULL, disk_usage, free_bytes

log = logging.getLogger("expbuf.store")
# The bytes kept for what makes room, at most: enough for a consume of the largest take (65,536
# experiences of groups of one: their tombstones and the pages their deletes change, 19 MB).
RESERVE = 32 << 20
# The least kept, where the map's bound or the disk is small (never more than half the map): LMDB
# reuses a page freed by a transaction only two transactions later, so the reserve must hold a few
# consumes' pages (a consume of 8 small groups of a records table changes some 60).
MIN_RESERVE = 1 << 20
# The data file is written ahead of its last page once the disk's free bytes are below this many reserves.
LOW_DISK = 16
# A batch with pushes counts the pages in use where the store's end is nearer than this many reserves.
NEAR = 4
# Pages in use that no named database counts: the two meta pages and the main database's.
_UNCOUNTED_PAGES = 4


def in_use(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], psize: int) -> int:
    """The bytes of the pages the databases use in `txn`: below LMDB's last page, those consumes and
    deletes freed are room again, which a count up to the last page (it only grows) does not show."""
    pages = _UNCOUNTED_PAGES
    for db in tuple(dbs.values()):  # another thread may add the rows' databases (open_rows)
        stat = txn.stat(db)
        pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
    return pages * psize


class Room:
    """How much room a data directory's pushes may take: the map's bound, or the data file's end on
    a disk that runs low, less a reserve."""

    def __init__(
        self, env: lmdb.Environment, path: Path, fd: int, max_map_size: int, dbs: Mapping[str, lmdb._Database]
    ) -> None:
        self.env, self.path, self._fd, self._dbs = env, path, fd, dbs
        self.max_map_size = max_map_size
        self._psize = env.stat()["psize"]
        disk = disk_usage(path)[0]
        # RESERVE, or less where the map's bound or the disk is small (an eighth, a sixteenth of it)
        fits = min(RESERVE, max_map_size // 8, disk // 16 if disk > 0 else RESERVE)
        self.reserve = max(fits, min(MIN_RESERVE, max_map_size // 2))
        self.ahead = 0  # where the data file was written ahead to (posix_fallocate); 0: not written ahead
        self.tight = False  # the disk had no room to write the file further ahead
        self._look_at = 0  # the map's use at which the disk is looked at next
        self._can_write_ahead = True  # False on a file system without posix_fallocate
        self._largest = 0  # the most a batch has moved the last page in use, in bytes
        self.was_short = False  # the last count found less than the reserve free: the next counts first
        self._short_at = 0  # the pages in use, in bytes, of the commit before the batch found short
        last = env.info()["last_pgno"]
        self.after_commit(last, last)  # a store opened on a disk that runs low is written ahead at once

    def used(self) -> int:
        """The bytes of the map up to its last page in use (LMDB's last_pgno, of the last commit)."""
        return (self.env.info()["last_pgno"] + 1) * self._psize

    def end(self) -> int:
        """The store's end for pushes: max_map_size, or the data file's end where it was written ahead."""
        return min(self.max_map_size, self.ahead) if self.ahead else self.max_map_size

    def near(self) -> bool:
        """Whether the store's last page is within NEAR reserves of its end, and the most a batch has
        moved it: a batch with pushes counts its room (a batch larger than any before may still take
        some of the reserve where it starts farther from the end)."""
        return self.used() + NEAR * self.reserve + self._largest > self.end()

    def short(self, txn: lmdb.Transaction[bytes]) -> bool:
        """Whether the batch in `txn` leaves less than the reserve free (its pages in use counted in
        it); where the file was written ahead and the disk has room, it is written further first.
        Short, the pages the last commit uses are noted for `still_short`."""
        in_use = self._in_use(txn)
        if self.ahead and in_use + 2 * self.reserve > self.ahead:
            self.write_ahead(max(in_use, self.used()))
        short = self.end() - in_use < self.reserve
        if short:
            with self.env.begin() as committed:
                self._short_at = self._in_use(committed)
        self.was_short = short
        return short

    def still_short(self) -> bool:
        """Whether no commit has lowered the pages in use since a count found the store short: its
        pushes are then refused before they run (a worker's pushes retried at the reserve each cost
        the writer their work), and after the first commit that frees a page, run and counted again."""
        with self.env.begin() as txn:
            if self._in_use(txn) >= self._short_at:
                return True
        self.was_short = False
        return False

    def _in_use(self, txn: lmdb.Transaction[bytes]) -> int:
        return in_use(txn, self._dbs, self._psize)

    def left(self) -> int:
        """The bytes between the last page in use and the store's end, for a refusal to name."""
        return max(self.end() - self.used(), 0)

    def after_commit(self, last_pgno: int, before: int) -> None:
        """Note how far the batch moved the last page in use (from `before` to `last_pgno`), and look at
        the disk once the map's use has grown a quarter of a reserve since the last look: write the file
        ahead where the disk runs low, and no more once it has twice that room again."""
        used = (last_pgno + 1) * self._psize
        self._largest = max(self._largest, (last_pgno - before) * self._psize)
        if used < self._look_at:
            return
        self._look_at = used + self.reserve // 4
        free = free_bytes(self.path)
        if self.ahead and not self.tight and free >= 2 * LOW_DISK * self.reserve:
            self.ahead = 0  # the disk has room again: the map's bound is the end, and nothing is counted
        elif self.ahead or 0 <= free < LOW_DISK * self.reserve:
            self.write_ahead(used)

    def write_ahead(self, used: int) -> None:
        """Extend the data file to three reserves past `used` (where it is less than two ahead); where
        the disk has no room for it, the store is `tight`, its pushes bound to the file's end."""
        reserve = self.reserve
        if not self._can_write_ahead or self.ahead >= used + 2 * reserve:
            return
        start = max(self.ahead, used)
        try:
            os.posix_fallocate(self._fd, start, used + 3 * reserve - start)
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                self._can_write_ahead = False
                log.warning(
                    "the data file of %s cannot be written ahead (%s): a full disk may stop consumes", self.path, exc
                )
                return
            self.ahead = max(self.ahead, os.fstat(self._fd).st_size)
            if not self.tight:
                log.error(
                    "the disk of %s is full (%s bytes free): pushes are refused; consumes, acks and deletes go on "
                    "in the %d bytes of the data file past its last page",
                    self.path,
                    free_bytes(self.path),
                    max(self.ahead - self.used(), 0),
                )
            self.tight = True
            return
        if self.tight:
            log.warning("the disk of %s has room again: pushes are taken", self.path)
        self.ahead, self.tight = used + 3 * reserve, False
