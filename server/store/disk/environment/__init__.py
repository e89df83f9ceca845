"""The LMDB environment of a data directory, and the one thread that writes to it.

Every change goes through the writer thread (writer.py), which applies every request waiting in its
queue in one write transaction and commits once with fsync: concurrent callers share the cost of
the fsync, and each returns only after that commit. Reads take transactions of their own, or
snapshots that outlive a call (readers.py), none held while the map grows. The environment
(lmdb_env.py) opens LMDB, brings the format up to date, and binds the two together.

Only one process may open a data directory: it holds an exclusive flock on the directory's
`data.mdb` for its life (directory.py), a lock the kernel keeps on the open file itself and drops
when the process ends, however it ends. No file's existence stands for the lock, so deleting one
(`lock.mdb`, or the `expbuf.lock` of earlier releases) lets no second server in. A reader that
never writes (`readonly`, for `expbuf check`) takes a shared lock instead and opens LMDB read-only
without its lock file, so it works on a read-only copy and writes nothing. A backup's copy
(directory.copy) reads one moment of a directory a server writes, its reader in LMDB's lock file.
"""

from .directory import copy
from .lmdb_env import Environment, Migration
from .readers import MAX_SNAPSHOTS
from .writer import STOP_POLL_SECONDS, Outcome, Request, Together, Writer, runs

__all__ = [
    "MAX_SNAPSHOTS", "STOP_POLL_SECONDS", "Environment", "Migration", "Outcome", "Request", "Together", "Writer",
    "copy", "runs",
]  # fmt: skip
