"""The data directory's format: recorded, checked at open, and brought up to date.

Format 1 (expbuf 0.1.0) kept its records as JSON and indexed experiences by task, run
and step. Opening such a directory rewrites every item, group and lease record in the
binary form of records.py and drops those indexes. Format 2 had no version index of
ready groups (byver, selection.py): it is built from the group records. Each step runs
in the one transaction of the open: a crash during it leaves the format found, and the
next open starts again. A directory of a newer format than this expbuf reads is refused,
naming both.
"""

from __future__ import annotations

import json
from pathlib import Path

import lmdb

from ..errors import StoreError
from ..selection import ReadyDbs, ReadyIndex
from . import layout
from .records import READY, GroupRecord, ItemRecord, Lease

_KEY = b"format"


def migrate(txn: lmdb.Transaction, env: lmdb.Environment, dbs: dict[str, lmdb._Database], path: Path) -> int:
    """Check the format of the directory and bring it to layout.FORMAT; returns the format found."""
    raw = txn.get(_KEY, db=dbs["meta"])
    # a directory without a recorded format is new, or of format 1 if it holds tables
    found = int(raw) if raw is not None else (1 if txn.stat(dbs["tables"])["entries"] else layout.FORMAT)
    if found > layout.FORMAT:
        raise StoreError(
            f"data directory {path} has format {found}, newer than this expbuf reads (up to {layout.FORMAT}): "
            "open it with the release that wrote it, or a newer one"
        )
    if found == 1:
        _from_1(txn, env, dbs)
    if found <= 2:
        _version_index(txn, dbs)
    if raw is None or found != layout.FORMAT:
        txn.put(_KEY, str(layout.FORMAT).encode(), db=dbs["meta"])
    return found


def _from_1(txn: lmdb.Transaction, env: lmdb.Environment, dbs: dict[str, lmdb._Database]) -> None:
    for db, kind in (("items", ItemRecord), ("groups", GroupRecord), ("leases", Lease)):
        rewritten = [(bytes(key), kind.from_v1(json.loads(value)).encode()) for key, value in txn.cursor(db=dbs[db])]
        for key, value in rewritten:
            txn.put(key, value, db=dbs[db])
    for name in layout.FORMAT_1_ONLY:
        txn.drop(env.open_db(name.encode(), txn=txn), delete=True)


def _version_index(txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
    """Index every ready group by its version, as selection.py keeps it from now on."""
    ready = ReadyDbs.of(dbs)
    for key, raw in txn.cursor(db=dbs["groups"]):
        grp = GroupRecord.decode(raw)
        if grp.state == READY:
            ReadyIndex(ready, txn, key[:4]).add_version(key[4:], grp.rseq, grp.priority, grp.version)
