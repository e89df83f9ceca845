"""A data directory's lock, its disk's room and its copy: only one process may write a data
directory, an operator's alerts read how much its disk holds (environment/__init__.py says how the
lock holds), and a backup is a copy of one moment of it, made while its server runs."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

import lmdb

from ...schema.errors import StorageFull, StoreError
from .. import layout

# How often a copy opens the directory again where its server grew the map as it opened (LMDB's
# MDB_MAP_RESIZED): a server doubles its map, so a few times cover any growth.
COPY_TRIES = 8
# What a write or posix_fallocate fails with where the disk (or the process's share of it) is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# LMDB's lock file at its 126 readers, the default: (126 - 1) readers of 64 bytes and its header.
LOCK_FILE_BYTES = 8192
# The name a copy is written under until it is whole (copy): never a data.mdb a server or check would open.
PARTIAL = ".data.mdb.partial"


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


def allocate_lock_file(directory: Path) -> None:
    """LMDB's lock file with its blocks allocated before LMDB opens it. LMDB makes the file sparse
    and writes its reader table through a shared map: on a full disk (a new directory, one restored
    from a backup of its data.mdb alone) the first write to a page the disk has no block for ended
    the process with SIGBUS and no word. A new lock file the disk has no room for is refused by
    name; one LMDB made before (its header written, its reader slots past the first page perhaps
    still sparse) is left as it was where the disk is full, so that a full store still opens to be
    emptied. A file system that cannot allocate ahead is left to LMDB as before."""
    path = directory / "lock.mdb"
    made = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError as exc:
        full = made and exc.errno in DISK_FULL
    else:
        full = False
    finally:
        os.close(fd)
    if full:
        path.unlink()
        raise StorageFull(
            f"the disk of {directory} is full (free: {free_bytes(directory)} bytes): LMDB's lock file "
            f"{path} needs {LOCK_FILE_BYTES} bytes of it; free some of the disk and start again"
        )


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


def copy(source: Path, target: Path) -> int:
    """Copy the data directory `source` as it stands at one moment into the new directory `target`
    (its data.mdb, compacted: the free pages left out); its size. Made while a server writes
    `source`, or with none: the copy reads one read transaction registered in LMDB's lock file, so
    the server's writer keeps every page it reads until it ends (the server's data file may grow
    by what it writes meanwhile); with no server, it holds the directory's shared lock instead, so
    that none starts before it ends, and reads a directory on read-only media too. A copy of the
    files themselves while a server writes is not a moment of it: one page from before a commit
    and another from after, which LMDB cannot read. The copy is written under a name of its own
    and renamed data.mdb once whole and synced: a copy that fails (a full disk, a damaged page)
    leaves nothing in `target`, and a `target` it made is removed."""
    if not (source / "data.mdb").is_file():
        raise StoreError(f"{source} holds no expbuf data (no data.mdb)")
    made = _empty_directory(target)
    partial = target / PARTIAL
    try:
        size = _copied(source, partial)
        partial.rename(target / "data.mdb")
        _synced(target)
        return size
    except BaseException:
        partial.unlink(missing_ok=True)
        if made:
            target.rmdir()
        raise


def _empty_directory(target: Path) -> bool:
    """Make `target`, or take it where it is an empty directory; whether it was made."""
    try:
        target.mkdir(parents=True)
        return True
    except FileExistsError:
        if not target.is_dir():
            raise StoreError(f"{target} is a file: a copy goes into a new or empty directory") from None
        if any(target.iterdir()):
            raise StoreError(f"{target} is not empty: a copy goes into a new or empty directory") from None
        return False
    except OSError as exc:
        raise StoreError(f"cannot make {target}: {exc.strerror}") from None


def cut_short(env: lmdb.Environment, path: Path) -> str | None:
    """What is wrong with a data file shorter than the pages its last commit uses (a copy or a
    restore cut short), or None: LMDB maps the file, and a read of a page past its end ends the
    process with SIGBUS and no word. A server writing the file grows it before it commits."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = (path / "data.mdb").stat().st_size
    if size >= used:
        return None
    return (
        f"data.mdb is {size} bytes, and its last commit uses {used}: the file was cut short (a copy or a "
        "restore that did not finish?); restore it whole"
    )


def _copied(source: Path, into: Path) -> int:
    """LMDB's compacted copy of `source` written to the file `into`, synced; its size."""
    try:
        held: int | None = lock(source / "data.mdb", shared=True)  # no server: none starts while this copies
    except StoreError:
        held = None  # a server's: the copy's reader goes into LMDB's lock file, which the server reads
    try:
        for _ in range(COPY_TRIES):
            try:
                env = lmdb.open(str(source), max_dbs=layout.MAX_DBS, readonly=True, lock=held is None, create=False)
            except lmdb.Error as exc:
                raise StoreError(f"cannot open {source}: {exc}") from None
            try:
                if (short := cut_short(env, source)) is not None:
                    raise StoreError(f"{source}: damaged ({short})")
                with open(into, "wb") as out:
                    env.copyfd(out.fileno(), compact=True)
                    os.fsync(out.fileno())
                    return os.fstat(out.fileno()).st_size
            except lmdb.MapResizedError:  # the server grew its map as this opened
                continue
            except (lmdb.Error, OSError) as exc:
                raise StoreError(f"cannot copy {source} to {into.parent}: {exc}") from None
            finally:
                env.close()
    finally:
        if held is not None:
            os.close(held)
    raise StoreError(f"cannot copy {source}: its server grew its map at each of {COPY_TRIES} tries")


def _synced(directory: Path) -> None:
    """The directory's entries on disk (a rename made durable)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
