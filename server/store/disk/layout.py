"""Where the store keeps what: its named LMDB databases and the keys in them.

Per-table keys start with the table's 4-byte id T (big-endian), so a table's entries are
one contiguous range:
- tables:    name -> {"id", "config", "created", "v"} (JSON)   meta: format, next table id
- items:     T + uid -> ItemRecord            blobs: T + uid -> the one-item TRXP payload, or the head
  of one whose tensor section is stored in chunks (chunked.py, its frame chunk_heads.py)
- chunks:    T + chunk set + chunk number -> a piece of a tensor section (chunked.py)
- staged:    T + chunk set -> when a push in chunks began staging it (until the push's commit)
- shared:    T + digest -> a prompt's tokens, stored once for the runs that carry them
  shared_refs: T + digest -> how many stored payloads refer to it (shared_prompts.py)
- kv:        T + a caller's key -> its value (keyed values, services/values.py); T + 0xFF + the key ->
  the value's record, its size and writer (rules/value_records.py; no UTF-8 key starts with 0xFF)
- partials:  T + uid + NUL -> a rollout held in pieces' head, T + uid + NUL + piece number -> a
  piece (piece_rows.py)
- tombs:     T + uid -> a compact tombstone (records.py) of a retired experience whose payload went
- adv:       T + uid -> token-level advantages (only estimators that have them)
- groups:    T + group key -> GroupRecord
- order:     T + seq -> uid (live experiences in insertion order: eviction, oldest age)
- pending:   T + created + group key -> b"" (incomplete groups, for group timeouts)
- compute:   T + rseq -> group key (complete groups waiting for their advantages)
- retired:   T + retired time + group key -> b"" (retired groups, whose members' tombstones are
  pruned together after tombstone_seconds)
- counters:  T -> counts by state, bytes and totals (JSON), updated in the same transaction;
  T + "indexes" -> the lazy indexes' databases the table keeps (absent: all; core/ordering/ready.IN_USE)
- ready groups: the databases of the registered orders' indexes (ready, prio, slots, slotof)
  and of the version index (byver), of the tables that keep them; see core/ordering/indexes.py and
  core/ordering/ready.py
- leases:    lease id -> Lease                lease_exp: expiry + lease id -> b""
- grants:    grant id -> {"t", "n", "e"} (JSON) grant_exp: expiry + grant id -> b"" (admission.py)
- cooling:   T + ready-again time + group key -> b"" (replayed groups cooling down, core/verbs/requeue.py)
- ledger:    T + a kind byte + ... -> the prompt ledger's datasets, prompts, queues, group entries
  and claim expiries (ledger_records.py)
Every key is at most 4 + 8 + 400 bytes (a uid or group id is at most 400), inside LMDB's
511-byte limit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import lmdb

from ..schema import order_names

# The form of the data directory: 1 kept JSON records and task, run and step indexes;
# 2 keeps binary records (records.py) and no such indexes; 3 adds the version index
# (byver) of ready groups; 4 digests payloads with XXH3-128, not SHA-256 (digests.py), and keeps
# compact tombstones in their own database (tombs); 5 adds the prompt ledger's database (ledger,
# ledger_records.py); 6 stores a tensor section larger than chunk_heads.CHUNK_BYTES in chunks (the
# chunks and staged databases); 7 stores a prompt its runs share once (the shared and shared_refs
# databases, shared_prompts.py) and keeps keyed values (kv, services/values.py); 8 keeps partial
# rollouts' pieces (partials, rules/partials.py); 9 takes a chunked payload's head's own digest over
# its chunk set too (chunk_heads.py, chunked.reseal_heads); 10 keeps every table in rows (issue 64:
# the databases of ROWS; core/whole_table/to_rows.py); 11 keeps a pending group's latest members'
# rows in its head (disk/rows/directory.PendingHead.inline), where 10 wrote a fragment a push. See
# migrate.py.
FORMAT = 11
DIRECTORY = ("meta", "tables", "leases", "lease_exp", "grants", "grant_exp")  # not per table
OWN = (
    *DIRECTORY, "items", "blobs", "adv", "groups", "order", "pending", "compute", "retired", "counters", "cooling",
    "tombs", "ledger", "chunks", "staged", "shared", "shared_refs", "kv", "partials",
)  # fmt: skip
# The databases of the rows a table of layout "rows" keeps (issue 64, disk/rows/; core/verbs/rows/segments.py
# writes them): gdir, T + group key -> a complete group's GroupRef or a pending group's head;
# segs, T + seg -> a segment; sstate, T + seg -> its SegState; runs, T + rseq -> a RunRow of ready
# groups (the ready order of a rows table, apart from the records' `ready` while both layouts live);
# frags, a pending group's fragments; oldest, T + when + a segment's id or a pending group's key ->
# b"", each segment's and pending or computing group's oldest live member (stats' oldest age:
# core/table_state/oldest_index.py; a directory that has the others without it gets it at its open).
# Not among OWN: only a directory that has held a rows table has them (Environment.open_rows), so
# opening, checking or reading a directory of records tables creates and finds nothing new.
ROWS = ("gdir", "segs", "sstate", "runs", "frags", "oldest")
# The indexes a directory written before the order registry keeps: those of the built-in orders.
BUILT_IN_INDEXES = ("ready", "prio", "slots", "slotof", "byver")
FORMAT_1_ONLY = ("tasks", "runs", "steps")
# Names a main database of expbuf's holds, in any format (its own databases'): one that holds others
# and none of these is another program's environment (lmdb_env.Environment._refuse_foreign).
KNOWN = frozenset((*OWN, *ROWS, *BUILT_IN_INDEXES, *FORMAT_1_ONLY))


def unrecorded_format(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database]) -> int | None:
    """The format of a directory with no format record: a new one's (FORMAT) where it has no table,
    format 1's (which recorded none) where it has that format's own databases (its "runs" is a
    rows table's name too); None where it has tables and not them: its record is lost to damage,
    and reading it as format 1, a server would upgrade a later format's records as format 1's."""
    if not txn.stat(dbs["tables"])["entries"]:
        return FORMAT
    return 1 if all(txn.get(name.encode()) is not None for name in ("tasks", "steps")) else None


MAX_DBS = 64  # the store's own, the indexes of the registered orders, and format 1's while it is upgraded


def index_databases() -> tuple[str, ...]:
    """The databases of the indexes the store keeps for the registered orders (order_names.py)."""
    names = order_names.DATABASES
    taken = set(names) & set(OWN + ROWS + FORMAT_1_ONLY)
    if taken:
        raise ValueError(f"an order's index names the store's own database(s) {', '.join(sorted(taken))}")
    return names


def databases() -> tuple[str, ...]:
    """Every database a store opens: its own, then the indexes'."""
    return OWN + index_databases()


def per_table(dbs: Iterable[str]) -> list[str]:
    """Of these databases, those keyed by table (a dropped table leaves nothing in them)."""
    return [name for name in dbs if name not in DIRECTORY]


# Numbers in keys, big-endian: LMDB orders keys byte by byte, so they sort as the numbers do.
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")


def u64(value: int) -> bytes:
    return U64.pack(value)


def put_rows(txn: lmdb.Transaction, db: lmdb._Database, rows: list[tuple[bytes, bytes]]) -> None:
    """Write (key, value) rows into one database in one call: a push writes hundreds."""
    if rows:
        with txn.cursor(db=db) as cur:
            cur.putmulti(rows)


def delete_rows(txn: lmdb.Transaction, db: lmdb._Database, keys: Iterable[bytes]) -> None:
    """Delete these keys from one database (absent ones are no error) through one cursor: a
    consume deletes hundreds, mostly side by side, and a cursor finds a key on the page it is on
    without a search from the root, its calls taking no keyword to parse."""
    with txn.cursor(db=db) as cur:
        drop = cur.delete
        for _ in filter(cur.set_key, keys):  # each found, the cursor on it
            drop()


def rows_under(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """The (key, value) rows of one database whose keys begin with `prefix` (a table's), the prefix
    taken off their keys: what reads a table's whole index or directory (a check, a repair) reads."""
    found = []
    with txn.cursor(db=db) as cur:
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix):
            found.append((bytes(cur.key()[len(prefix) :]), bytes(cur.value())))
            at = cur.next()
    return found


def next_prefix(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with prefix."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def prio_key(priority: float) -> bytes:
    """Big-endian bytes that sort by priority descending."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(priority)))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | 1 << 63  # ascending order of floats
    return u64(bits ^ 0xFFFFFFFFFFFFFFFF)  # flip for descending


def priority_of(key: bytes | memoryview) -> float:
    """The priority a prio_key was made of."""
    bits = U64.unpack(key)[0] ^ 0xFFFFFFFFFFFFFFFF  # ascending again
    bits = bits ^ (1 << 63) if bits >> 63 else bits ^ 0xFFFFFFFFFFFFFFFF
    (priority,) = struct.unpack(">d", struct.pack(">Q", bits))
    return float(priority)


def version_key(version: int) -> bytes:
    """A signed 64-bit version as 8 bytes that sort in its order."""
    return u64(version + (1 << 63))


def table_prefix(table_id: int) -> bytes:
    return U32.pack(table_id)


def table_of(key: bytes) -> int:
    table_id: int = U32.unpack(key[:4])[0]
    return table_id


def micros(seconds: float) -> bytes:
    """A time as 8 sortable bytes (microseconds; times before 1970 sort first as 0)."""
    return u64(max(0, int(seconds * 1e6)))


def expiry_key(expires: float, lease_id: str) -> bytes:
    return micros(expires) + lease_id.encode()


def expiry_of(key: bytes) -> float:
    stamp: int = U64.unpack(key[:8])[0]
    return stamp / 1e6


def due(txn: lmdb.Transaction[bytes], db: lmdb._Database, now: float, limit: int) -> list[bytes]:
    """The keys of an expiry index (expiry_key: leases', grants') due by `now`, oldest first, at
    most `limit`."""
    expired = list[bytes]()
    with txn.cursor(db=db) as cur:
        for key, _ in cur:
            if expiry_of(key) > now or len(expired) >= limit:
                break
            expired.append(bytes(key))
    return expired


def stamped_before(
    txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes, cutoff: float, limit: int
) -> list[bytes]:
    """The keys of a table's time-ordered index (T + micros + ...) stamped before `cutoff`, oldest
    first, at most `limit`."""
    stamp, found = micros(cutoff), list[bytes]()
    with txn.cursor(db=db) as cur:
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix) and cur.key()[4:12] < stamp and len(found) < limit:
            found.append(bytes(cur.key()))
            at = cur.next()
    return found


def first_time(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> bytes | None:
    """The time (8 sortable bytes) of a table's first key in a time-ordered index (T + micros + ...)."""
    with txn.cursor(db=db) as cur:
        if cur.set_range(prefix) and cur.key().startswith(prefix):
            return bytes(cur.key()[4:12])
    return None
