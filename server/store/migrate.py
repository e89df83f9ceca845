"""The data directory's format: recorded, checked at open, and brought up to date.

Format 1 (expbuf 0.1.0) kept its records as JSON and indexed experiences by task, run
and step. Opening such a directory rewrites every item, group and lease record in the
binary form of records.py (live experiences get the digest of today's canonical packing,
so a retried push of one is still a duplicate) and drops those indexes. Format 2 had no
version index of ready groups (byver, selection.py): it is built from the group records.
Each step runs in the one transaction of the open: a crash during it leaves the format
found, and the next open starts again. A directory of a newer format than this expbuf
reads is refused, naming both.
"""

from __future__ import annotations

import json
from pathlib import Path

import lmdb

from expbuf.client import trxp

from ..errors import StoreError
from ..selection import ReadyDbs, ReadyIndex
from ..tables import TableConfig, batch_stage
from . import layout
from .extensions import Extensions
from .kinds import Entry
from .records import COMPUTING, READY, GroupRecord, ItemRecord, Lease
from .table_state import TableState

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
    for db, kind in (("groups", GroupRecord), ("leases", Lease)):
        rewritten = [(bytes(key), kind.from_v1(json.loads(value)).encode()) for key, value in txn.cursor(db=dbs[db])]
        for key, value in rewritten:
            txn.put(key, value, db=dbs[db])
    items = [(bytes(key), ItemRecord.from_v1(json.loads(value))) for key, value in txn.cursor(db=dbs["items"])]
    for key, record in items:
        blob = txn.get(key, db=dbs["blobs"])
        if blob is not None:  # digests are now of the canonical packing: a retried push stays a duplicate
            record.digest = Entry.of(trxp.parse(blob, trusted=True)[0]).digest
        txn.put(key, record.encode(), db=dbs["items"])
    _recompute_batch_stage_tables(txn, dbs)
    for name in layout.FORMAT_1_ONLY:
        txn.drop(env.open_db(name.encode(), txn=txn), delete=True)


def _recompute_batch_stage_tables(txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
    """Format 1's grpo over the batch's std and its reinforce++ stored final advantages;
    today their namesakes store per-group values that a batch stage finishes at sample
    time. Their ready groups are computed again (leased ones are out: their lease ends
    them)."""
    for _, raw in txn.cursor(db=dbs["tables"]):
        record = json.loads(raw)
        config = TableConfig.from_stored(record["config"], record.get("v", 1))
        if not batch_stage(config):
            continue
        tt = TableState(txn, dbs, record["id"], config, 0.0, Extensions())  # queues its groups itself
        for gkey_raw in list(tt.ready.scan(dbs["ready"], reverse=False)):
            gkey = bytes(gkey_raw).decode()
            grp = tt.group(gkey)
            tt.ready.remove(gkey_raw, grp.rseq, grp.priority, grp.version)
            recs = tt.members(grp)
            for rec in recs.values():
                rec.advantage = None
            tt.set_state(gkey, grp, recs, COMPUTING)
            txn.put(tt.rseq_key(grp), gkey_raw, db=dbs["compute"])
        tt.save()


def _version_index(txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
    """Index every ready group by its version, as selection.py keeps it from now on."""
    ready = ReadyDbs.of(dbs)
    for key, raw in txn.cursor(db=dbs["groups"]):
        grp = GroupRecord.decode(raw)
        if grp.state == READY:
            ReadyIndex(ready, txn, key[:4]).add_version(key[4:], grp.rseq, grp.priority, grp.version)
