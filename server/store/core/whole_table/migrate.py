"""The data directory's format: recorded, checked at open, and brought up to date.

Format 1 (expbuf 0.1.0) kept its records as JSON and indexed experiences by task, run
and step. Opening such a directory rewrites every item, group and lease record in the
binary form of records.py (live experiences get the digest of today's canonical packing,
so a retried push of one is still a duplicate) and drops those indexes. Format 2 had no
version index of ready groups (byver, core/ordering/indexes.py): it is built from the group records.
Format 3 digested payloads with SHA-256: every stored payload gets its XXH3-128 digest
(digests.py), and tombstones keep theirs (`_digests_to_xxh3`). Format 3 also kept a retired
experience's whole record as its tombstone; format 4 keeps a compact one (records.py) in a
database of its own (tombs), and its retired index names groups, not experiences: the upgrade
moves the old tombstones and rebuilds the index (`compact_tombstones`). A leased group's
members keep ready records from format 4 (`ready_while_leased`). Format 6 adds the databases
of tensor sections stored in chunks (chunked.py), created empty by the open's transaction:
every payload a format 5 directory holds is stored whole, as format 6 stores a small one.
Format 7 adds those of prompts stored once for the runs that share them (shared_prompts.py)
and of keyed values (services/values.py), created empty in the same way: a format 6
directory's payloads stay whole, and only pushes from then on share their prompts. Format 8
adds the database of partial rollouts' pieces (rules/partials.py), created empty as well. Format 9
takes the own digest of a head of a payload stored in chunks over the number of its chunk set too
and marks each set with its experience's key (chunked.reseal_heads): each head of a format 6 to 8
directory that matches its old digest gets the new one and its mark, a damaged one is left for the
read check to find. Format 10 keeps every table in rows (issue 64): each table of layout records
is made one of layout rows (to_rows.py). Format 11 keeps a pending group's latest members in its
head rather than in a fragment of their own: a format 10 head (its members all in fragments) is a
format 11 head as it is, so the step writes the format alone, and an older expbuf, which would not
read the members a head keeps, refuses the directory.
A directory whose rows tables were written before the index of their oldest live experiences
(core/table_state/oldest_index.py) gets it built from their segments and pending groups, in the
same transaction; it is no step of the format (a directory without rows tables has no such index,
and the upgrade to rows writes it as it writes the rows).
The indexes of the registered orders are not the format's: `keep_indexes` builds the index of
an order registered since the last open and drops one no order reads any more. Which indexes a
table keeps is marked per table (core/ordering/ready.IN_USE, in the counters database); a table without
the mark, as every table written before it, keeps every index, so no format step is needed.
Each step runs in the one transaction of the open: a crash during it leaves the format
found, and the next open starts again. A directory of a newer format than this expbuf
reads is refused, naming both.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lmdb

from expbuf.client.trxp.codec.build import pack_item
from expbuf.client.trxp.codec.common import TrxpError
from expbuf.client.trxp.codec.parse import parse

from ...disk import chunked, digests, layout
from ...disk.kinds import Entry
from ...disk.records import GroupRecord, ItemRecord, Lease
from ...schema.errors import StoreError
from ...schema.states import COMPUTING, LEASED, READY
from ...schema.table_config import TableConfig, batch_stage
from ..ordering import orders
from ..ordering.indexes import Index, ReadyGroup, ReadyOrder, VersionIndex
from ..ordering.ready import forget_builds, forget_kept, in_use, keeps
from ..table_state import oldest_index
from ..table_state.events import TableExtension
from ..table_state.state import TableState
from .to_rows import to_rows

_KEY = b"format"
_INDEXES = b"indexes"  # the index databases kept, as a JSON list (absent: the built-in orders')


def migrate(txn: lmdb.Transaction[bytes], env: lmdb.Environment, dbs: dict[str, lmdb._Database], path: Path) -> int:
    """Check the format of the directory and bring it to layout.FORMAT; returns the format found."""
    raw = txn.get(_KEY, db=dbs["meta"])
    if raw is not None:
        found = int(raw)
    else:  # a directory without a recorded format is new, or of format 1 if it holds that format's tables
        unrecorded = layout.unrecorded_format(txn, dbs)
        if unrecorded is None:
            raise StoreError(
                f"data directory {path}: its format record is gone, and its tables are of a later format than 1: "
                "it is damaged (`expbuf check` names what else); restore it from a copy"
            )
        found = unrecorded
    if found > layout.FORMAT:
        raise StoreError(
            f"data directory {path} has format {found}, newer than this expbuf reads (up to {layout.FORMAT}): "
            "open it with the release that wrote it, or a newer one"
        )
    if found == 1:
        _from_1(txn, env, dbs)
    if found <= 2:
        build(txn, dbs, [VersionIndex])
    if found in (2, 3):  # format 1's upgrade digests its payloads anew as it is
        _digests_to_xxh3(txn, dbs)
    if found <= 3:  # after the digests: a tombstone keeps the digest it has
        compact_tombstones(txn, dbs)
        ready_while_leased(txn, dbs)
    if 6 <= found <= 8:  # no payload was stored in chunks before format 6
        chunked.reseal_heads(txn, dbs)
    if found <= 9:
        to_rows(txn, env, dbs)
    if raw is None or found != layout.FORMAT:
        txn.put(_KEY, str(layout.FORMAT).encode(), db=dbs["meta"])
    if "gdir" in dbs and "oldest" not in dbs:  # rows tables written before their index of the oldest
        dbs["oldest"] = env.open_db(b"oldest", txn=txn)
        oldest_index.build(txn, dbs)
    keep_indexes(txn, env, dbs)
    return found


def keep_indexes(txn: lmdb.Transaction[bytes], env: lmdb.Environment, dbs: dict[str, lmdb._Database]) -> None:
    """The directory keeps the indexes of the registered orders: one registered since the last
    open is built from the ready groups, one that no order reads any more is dropped (and
    built anew should its order come back), so an index is never read after a stretch of
    changes it missed (unless a release from before the registry served the directory in
    between: it keeps the built-in orders' indexes only)."""
    raw = txn.get(_INDEXES, db=dbs["meta"])
    kept = set(json.loads(raw)) if raw is not None else set(layout.BUILT_IN_INDEXES)
    names = set(layout.index_databases())
    for name in sorted(kept - names):
        txn.drop(env.open_db(name.encode(), txn=txn), delete=True)
    build(txn, dbs, [index for index in orders.indexes() if not set(index.databases) <= kept])
    if names != kept:
        txn.put(_INDEXES, json.dumps(sorted(names)).encode(), db=dbs["meta"])


def build(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], indexes: list[type[Index]]) -> None:
    """Fill these indexes (emptied first, and the builds under way of them forgotten) with the
    ready groups of every table that keeps them, in ready order; a rows table keeps them no more,
    until a request reads one again (ready.ReadyIndex)."""
    if not indexes:
        return
    for index in indexes:
        for name in index.databases:
            txn.drop(dbs[name], delete=False)
    for _, raw in txn.cursor(db=dbs["tables"]):  # a build under way of an index emptied here starts over
        record = json.loads(raw)
        forget_builds(txn, dbs, layout.table_prefix(record["id"]), indexes)
        if TableConfig.from_stored(record["config"], record.get("v", 1)).storage.layout == "rows":
            forget_kept(txn, dbs, layout.table_prefix(record["id"]), indexes)  # kept again from its next read
    prefix, ready = b"", list[ReadyGroup]()
    # The groups of a table are one run of keys; an empty key ends the last run.
    for key, raw in itertools.chain(txn.cursor(db=dbs["groups"]), [(b"", b"")]):
        if key[:4] != prefix:
            ready.sort(key=lambda group: group.rseq)
            used = in_use(txn, dbs, prefix) if ready else None
            for index in indexes if ready else ():
                if keeps(used, index):  # a table not reading it builds it when it does
                    index(dbs, txn, prefix).add(ready)
            prefix, ready = bytes(key[:4]), []
        if key:
            grp = GroupRecord.decode(raw)
            if grp.state == READY:
                ready.append(ReadyGroup(bytes(key[4:]), grp.ready_seq, grp.priority, grp.version))


def compact_tombstones(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
    """Format 4's step. Tombstones kept as whole item records (every one before format 4)
    move to the tombs database in the compact form, so that the space they held comes back
    at the upgrade rather than as they are pruned, and a format-4 directory keeps one form
    (which `expbuf check` checks); a failed experience whose payload is kept (keep_failed)
    keeps its full record. The retired index, which named every tombstone, names each
    retired group once, at the time its members were retired. Found through that index:
    live records are not read."""
    moved, groups = [], set()
    for key in txn.cursor(db=dbs["retired"]).iternext(values=False):
        item = bytes(key[:4] + key[12:])  # retired: T + retired time + uid; items: T + uid
        raw = txn.get(item, db=dbs["items"])
        if raw is None:
            continue
        rec = ItemRecord.decode(raw)
        groups.add(bytes(key[:12]) + rec.group.encode())
        if txn.get(item, db=dbs["blobs"]) is None:
            moved.append((item, rec.tombstone()))
    moved.sort()
    for item, tombstone in moved:
        txn.delete(item, db=dbs["items"])
        txn.put(item, tombstone, db=dbs["tombs"])
    txn.drop(dbs["retired"], delete=False)
    for key in sorted(groups):
        txn.put(key, b"", db=dbs["retired"])


def ready_while_leased(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
    """Format 4's other step. A leased group's members were rewritten leased, and counted as
    sampled, when the lease was taken; from format 4 their records stay ready while the
    group's says leased, and count the lease when it ends. So each is rewritten ready, and
    the lease it was counted for is taken back (not for a replayed group cooling down, whose
    count is its replay's)."""
    rewritten = []
    for key, raw in txn.cursor(db=dbs["groups"]):
        grp = GroupRecord.decode(raw)
        if grp.state != LEASED:
            continue
        for uid in grp.members:
            item = bytes(key[:4]) + uid.encode()
            found = txn.get(item, db=dbs["items"])
            rec = None if found is None else ItemRecord.decode(found)
            if rec is not None and rec.state == LEASED:
                rec.state = READY
                if grp.lease:
                    rec.times_sampled -= 1
                rewritten.append((item, rec.encode()))
    for item, value in rewritten:
        txn.put(item, value, db=dbs["items"])


def _from_1(txn: lmdb.Transaction[bytes], env: lmdb.Environment, dbs: dict[str, lmdb._Database]) -> None:
    for db, kind in (("groups", GroupRecord), ("leases", Lease)):
        rewritten = [(bytes(key), kind.from_v1(json.loads(value)).encode()) for key, value in txn.cursor(db=dbs[db])]
        for key, value in rewritten:
            txn.put(key, value, db=dbs[db])
    items = [(bytes(key), ItemRecord.from_v1(json.loads(value))) for key, value in txn.cursor(db=dbs["items"])]
    for key, record in items:
        blob = txn.get(key, db=dbs["blobs"])
        if blob is not None:  # digests are now of the canonical packing: a retried push stays a duplicate
            record.digest = Entry.of(parse(blob, trusted=True)[0]).digest
        txn.put(key, record.encode(), db=dbs["items"])
    _recompute_batch_stage_tables(txn, dbs)
    for name in layout.FORMAT_1_ONLY:
        txn.drop(env.open_db(name.encode(), txn=txn), delete=True)


def _digests_to_xxh3(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
    """Give every experience whose payload is stored the digest format 4 takes at push: that of the
    payload, or, for a payload kept as format 1 wrote it, of its canonical packing (as Entry.of
    takes it), once the SHA-256 digest has shown it undamaged; a damaged one keeps its digest, for
    the check at open to name. A tombstone keeps its SHA-256 digest, which pushes.put still
    recognises, so a retried push of it stays a duplicate until it is pruned. Each record is
    rewritten as the scan passes it, at the same size, so the upgrade holds no list of them."""
    with txn.cursor(db=dbs["items"]) as cur:
        for raw_key, raw in cur:
            key = bytes(raw_key)
            blob = txn.get(key, db=dbs["blobs"])
            if blob is None:
                continue
            record = ItemRecord.decode(raw)
            if record.digest != digests.format_3(blob):
                packed = _packed(blob)  # a payload kept as format 1 wrote it, or a damaged one
                if packed is None or record.digest != digests.format_3(packed):
                    continue  # damaged: left as it is, for the check at open to name
                blob = packed
            record.digest = digests.of(blob)
            cur.put(key, record.encode())


def _packed(blob: bytes) -> bytes | None:
    """A payload kept as format 1 wrote it, packed as Entry.of packs it; None if it does not parse."""
    try:
        return pack_item(parse(blob, trusted=True)[0])
    except TrxpError:
        return None


def _recompute_batch_stage_tables(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
    """Format 1's grpo over the batch's std and its reinforce++ stored final advantages;
    today their namesakes store per-group values that a batch stage finishes at sample
    time. Their ready groups are computed again (leased ones are out: their lease ends
    them)."""
    for _, raw in txn.cursor(db=dbs["tables"]):
        record = json.loads(raw)
        config = TableConfig.from_stored(record["config"], record.get("v", 1))
        if not batch_stage(config):
            continue
        tt = TableState(txn, dbs, record["id"], config, 0.0, TableExtension())  # no extension hears an upgrade
        computing = []
        for gkey_raw in list(tt.ready.of(ReadyOrder).scan(reverse=False)):
            gkey = bytes(gkey_raw).decode()
            grp = tt.existing_group(gkey)
            tt.ready.remove(gkey_raw, grp.ready_seq, grp.priority, grp.version)
            recs = {uid: tt.existing_item(uid) for uid in grp.members}
            for rec in recs.values():
                rec.advantage = None
            computing.append((gkey, grp, recs))
        tt.set_states(computing, COMPUTING)  # and in the compute queue, in the ready order
        tt.save()
