"""A data directory's LMDB environment: its lock taken (directory.py), LMDB opened with its named
databases and its format brought up to date, its writer (writer.py) and readers (readers.py) over
it, and its room reported; closed once every queued request is committed."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from ...schema.errors import Damaged, StorageFull, StoreError, clip
from .. import layout
from .directory import allocate_lock_file, cut_short, disk_usage, free_bytes, lock
from .readers import Readers
from .room import Room, in_use
from .writer import Writer

# What brings a directory to the current format (migrate.py's `migrate`), given by the Store:
# it works on tables, a layer above the environment.
Migration = Callable[["lmdb.Transaction[bytes]", lmdb.Environment, dict[str, lmdb._Database], Path], Any]
# What LMDB, or the format's records, raise on a damaged page (a full disk or map is not damage).
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.PanicError,
    lmdb.BadValsizeError,
    lmdb.IncompatibleError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
)


class Environment:
    """A data directory's LMDB environment, its named databases and its writer thread. What the
    store calls it for is its writer's (submit, queue, nested transactions, the batches committed)
    and its readers' (read, snapshot), bound here once so that a call costs no step more."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        batch_limit: int = 512,
        readonly: bool = False,
        migrate: Migration | None = None,
    ) -> None:
        self.path = Path(path)
        if migrate is None and not readonly:
            raise TypeError("a writable Environment needs the migration that brings its format up to date")
        self.readonly = readonly
        self._migration = migrate
        self.missing: list[str] = []  # databases a read-only open did not find (an older format)
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock(self.path / "data.mdb", readonly)
        self.max_map_size = max_map_size
        try:
            self._open(map_size)
        except BaseException:
            if hasattr(self, "env"):
                self.env.close()
            os.close(self._lock_fd)
            raise
        self.readers = Readers(self.env)
        room = None if readonly else Room(self.env, self.path, self._lock_fd, max_map_size, self.db)
        self.writer = Writer(
            self.env,
            self.path,
            self.readers,
            max_map_size=max_map_size,
            batch_limit=batch_limit,
            readonly=readonly,
            room=room,
        )
        writer = self.writer
        self.submit, self.queue, self.wait_for_change, self.wake = (
            writer.submit,
            writer.queue,
            writer.wait_for_change,
            writer.wake,
        )
        self.nested, self.views, self.run_nested = writer.nested, writer.views, writer.run_nested
        self.read, self.snapshot = self.readers.read, self.readers.snapshot

    def clear_stale_readers(self) -> int:
        """Free the reader slots that processes which ended left in LMDB's lock file (an `expbuf
        backup` killed mid-copy): each kept every page freed after it from reuse, the data file
        growing by all the server wrote, until a restart. How many were freed."""
        return 0 if self.readonly else self.env.reader_check()

    @property
    def batches(self) -> int:
        """Batches of requests the writer has run, committed or not."""
        return self.writer.batches

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self.writer.generation

    def _open(self, map_size: int) -> None:
        """Open LMDB and its databases, and bring the format up to date (not when read-only).

        A directory LMDB or the format's records cannot read is Damaged, naming `expbuf check`.
        """
        names = layout.databases()  # the registered orders' indexes may be refused before anything opens
        try:
            if self.readonly:
                self.env = lmdb.open(
                    str(self.path), max_dbs=layout.MAX_DBS, readonly=True, lock=False, readahead=False, create=False
                )
                self._whole()
                self.db = {}
                for name in names + layout.ROWS:
                    try:
                        self.db[name] = self.env.open_db(name.encode(), create=False)
                    except lmdb.NotFoundError:
                        if name not in layout.ROWS:  # the rows' are made only for a rows table
                            self.missing.append(name)
                return
            allocate_lock_file(self.path)
            self.env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=layout.MAX_DBS, sync=True, metasync=True, readahead=False
            )
            self._whole()
            self._migrate(names)
        except _DAMAGE as exc:
            raise Damaged(self.path, f"{type(exc).__name__}: {exc}") from None

    def _whole(self) -> None:
        """Refuse a data file shorter than the pages its last commit uses (a copy or a restore cut
        short): LMDB maps the file, and a read of a page past its end ended the process with SIGBUS
        and no word, at the open or at the first read of that page, in `serve` and in `check`
        alike. Without a writable map, the pages a commit uses are always in the file."""
        short = cut_short(self.env, self.path)
        if short is not None:
            raise Damaged(self.path, short)

    def _migrate(self, names: tuple[str, ...]) -> None:
        """Open the databases and bring the directory to the current format, growing the map if
        the rewrite needs it. The databases a newer format adds are created in the upgrade's own
        transaction: a start killed before its commit leaves the directory as it found it."""
        data = self.path / "data.mdb"
        while True:
            before, found = data.stat().st_size, None
            try:
                with self.env.begin(write=True) as txn:
                    self._refuse_foreign(txn)
                    self.db = {name: self.env.open_db(name.encode(), txn=txn) for name in names}
                    # the rows' databases where a rows table made them (open_rows), left absent elsewhere
                    made = [name for name in layout.ROWS if txn.get(name.encode()) is not None]
                    self.db |= {name: self.env.open_db(name.encode(), txn=txn) for name in made}
                    if self._migration is not None:
                        found = self._migration(txn, self.env, self.db, self.path)
                return
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size >= self.max_map_size:
                    raise StorageFull(f"upgrading {self.path} needs more than max_map_size ({size} bytes)") from None
                self.env.set_mapsize(min(size * 2, self.max_map_size))
            except _DAMAGE:
                raise
            except lmdb.Error as exc:  # a full or failing disk: the commit kept nothing, and gives back what it wrote
                raise self._unwritten(data, before, found, exc) from None

    def _unwritten(self, data: Path, before: int, found: object, exc: lmdb.Error) -> StorageFull:
        """The refusal of a start whose one write (its upgrade's, where `found` is an older format)
        failed: the data file cut back to its length before it (the pages the failed commit wrote
        past the last one it keeps took a full disk's last bytes), the directory as it was."""
        grown = data.stat().st_size - before
        if grown > 0:
            os.truncate(data, before)
        upgrade = isinstance(found, int) and found < layout.FORMAT
        what = (
            f"upgrading {self.path} from data format {found} to {layout.FORMAT}" if upgrade else f"opening {self.path}"
        )
        wrote = f"; it had written {grown} bytes more when it failed, given back" if grown > 0 else ""
        return StorageFull(
            f"{what} failed writing to its disk (is it full or failing? free: {free_bytes(self.path)} bytes{wrote}):"
            f" the directory is as it was; where the disk is full, free some of it (or move the directory to a"
            f" larger one) and start again (LMDB said: {exc})"
        )

    def _refuse_foreign(self, txn: lmdb.Transaction[bytes]) -> None:
        """Refuse an LMDB environment another program made (a `data` path mistyped, a shared
        volume), before anything is written to it: one whose main database holds names and none of
        expbuf's was taken for a new directory, and expbuf's databases were made beside the other
        program's."""
        with txn.cursor() as cursor:
            found = [bytes(key).decode(errors="replace") for key in itertools.islice(cursor.iternext(values=False), 64)]
        if found and not set(found) & layout.KNOWN:
            shown = ", ".join(clip(name, 40) for name in found[:8])
            raise StoreError(
                f"{self.path} is not an expbuf data directory: its LMDB environment holds {shown}"
                f"{', ...' if len(found) > 8 else ''}, none of expbuf's databases; point `data` at a directory of"
                " expbuf's own (a new one is made where none is)"
            )

    def open_rows(self) -> None:
        """The databases of the rows (layout.ROWS), made where they are not yet, before the first
        table of layout "rows" is created: in a transaction of their own (a background one, never
        nested in a batch's, whose refusal would close a handle made in it), their handles shared
        once it has committed. Called off the writer thread."""
        if all(name in self.db for name in layout.ROWS):
            return

        def made(txn: lmdb.Transaction[bytes]) -> dict[str, lmdb._Database]:
            return {name: self.env.open_db(name.encode(), txn=txn) for name in layout.ROWS}

        self.db.update(self.submit(made, background=True))

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        if not self.writer.stop():
            return
        self.readers.detach_snapshots()
        self.env.close()
        os.close(self._lock_fd)

    def storage_info(self) -> dict[str, float]:
        """The map's size, its bound (max_map_size) and use (up to its last page, and the pages in use
        below it), the room on the data directory's disk
        (both bound what the store can hold: an operator's alerts read them), and the prompts stored
        once for the runs that share them (shared_prompts.py): how many, and the bytes of their pages."""
        with self.read() as txn:  # as a reader: never across a resize of the map, which it would see half done
            info, stat = self.env.info(), self.env.stat()
            shared = txn.stat(self.db["shared"]) if "shared" in self.db else None
            pages = in_use(txn, self.db, stat["psize"])
        disk_bytes, disk_free = disk_usage(self.path)
        used = (info["last_pgno"] + 1) * stat["psize"]
        prompts = prompt_bytes = 0
        if shared is not None:
            prompts = shared["entries"]
            prompt_bytes = (shared["branch_pages"] + shared["leaf_pages"] + shared["overflow_pages"]) * shared["psize"]
        return {
            "map_size": info["map_size"],
            "max_map_size": self.max_map_size,
            "used_bytes": used,  # up to LMDB's last page: the data file's high-water mark
            "in_use_bytes": pages,  # the pages the databases use: what consumes free is room again
            "map_used_ratio": used / info["map_size"],
            "disk_bytes": disk_bytes,
            "disk_free_bytes": disk_free,
            "shared_prompts": prompts,
            "shared_prompt_bytes": prompt_bytes,
        }
