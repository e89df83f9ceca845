"""Format 10: every table of layout `records` becomes a table of layout `rows` (issue 64), in the
open's one transaction (migrate.py): a start killed during it leaves format 9 as it was, and the
next start upgrades it again.

Each group record becomes what a rows table keeps of a group in its state, its members' records
their rows, and nothing changes of what the table serves or counts:
- a ready, leased or cooling group goes into a segment at its place in the ready order (its rseq:
  groups at consecutive places share segments, as a push's do), a ready one in a run, a leased one
  with its lease's tag, a cooling one leased to no one with its new priority in its cooling row;
  each lease of groups becomes a lease of runs naming the same groups in the same order;
- a pending group keeps its row in the pending index, with a head in the group directory holding its
  members' rows (in one fragment where they pass SPILL_BYTES); a computing one keeps its row in the
  compute queue, its head naming it;
- a retired group (its members' tombstones, or a failed group's kept records) goes into a retired
  segment at a new place, retired when it was (the retired index names the segment then), which
  keeps its members' digests for a retried push, a quarantined member flagged so in its state.
The indexes the table kept stay as they are (a group's place is the rseq it had, its priority and
version in its segment what its record held), a build under way of one goes on from where it was;
its records, tombstones, insertion order and the ready order's index are deleted. The payloads, their
token-level advantages, chunks, shared prompts, pieces and the prompt ledger are kept by uid or by
group, as a rows table keeps them: they are not touched.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator, Sequence

import lmdb

from ...disk import layout
from ...disk.records import GroupRecord, ItemRecord, Lease
from ...disk.rows import Group, GroupRef, Member, RowLease, RunRow, directory_entry
from ...disk.rows.runs import decode_lease
from ...schema.states import COMPUTING, LEASED, PENDING, QUARANTINED, READY, RETIRED, State
from ...schema.table_config import CONFIG_VERSION, TableConfig
from ..ordering import orders
from ..ordering.indexes import ReadyOrder
from ..ordering.ready import forget_builds, in_use, keeps, mark_in_use
from ..table_state.events import TableExtension
from ..table_state.state import TableState
from ..verbs.rows import pending as row_pending
from ..verbs.rows import segments
from ..verbs.rows.requeue import COOLING_PRIORITY
from ..verbs.rows.select import NO_LEASE, Segments


def to_rows(txn: lmdb.Transaction[bytes], env: lmdb.Environment, dbs: dict[str, lmdb._Database]) -> int:
    """Every records table of the directory made a rows table (the rows' databases made, where they
    are not, in this transaction); returns how many."""
    found = [
        (bytes(name), record)
        for name, raw in txn.cursor(db=dbs["tables"])
        if (record := json.loads(raw))["config"].get("layout", "records") == "records"
    ]
    if not found:
        return 0
    # opened here whatever the open found: a format-1 directory's own `runs` (its run index) was
    # dropped by its upgrade in this transaction, its handle with it
    dbs |= {name: env.open_db(name.encode(), txn=txn) for name in layout.ROWS}
    places: dict[str, GroupRef] = {}  # each leased group's place, by table prefix and key
    for name, record in found:
        stored = TableConfig.from_stored(record["config"], record.get("v", 1))
        config = dataclasses.replace(stored, storage=dataclasses.replace(stored.storage, layout="rows"))
        places |= _table(txn, dbs, record["id"], config)
        record["config"], record["v"] = config.to_stored(), CONFIG_VERSION  # as this release stores it
        txn.put(name, json.dumps(record).encode(), db=dbs["tables"])
    _leases(txn, dbs, {record["id"] for _, record in found}, places)
    return len(found)


def _table(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], table_id: int, config: TableConfig
) -> dict[str, GroupRef]:
    """One table's groups as rows; returns its leased groups' places (by prefix + key)."""
    prefix = layout.table_prefix(table_id)
    used = in_use(txn, dbs, prefix)
    kept = [cls for cls in orders.KEPT if all(n in dbs for n in cls.databases) and keeps(used, cls)]
    for db_name in ReadyOrder.databases:  # a rows table's ready order is its runs
        ReadyOrder(dbs, txn, prefix).clear(db_name, 1 << 62)
    forget_builds(txn, dbs, prefix, [ReadyOrder])
    # the indexes kept stay as they are: each group keeps its place (its rseq), priority and version
    mark_in_use(txn, dbs, prefix, {name for cls in kept if cls is not ReadyOrder for name in cls.databases})
    tt = TableState(txn, dbs, table_id, config, 0.0, TableExtension())  # no extension hears an upgrade
    by_state: dict[State, list[tuple[str, GroupRecord]]] = {}
    for key, raw in _under(txn, dbs["groups"], prefix):
        grp = GroupRecord.decode(raw)
        by_state.setdefault(grp.state, []).append((key[len(prefix) :].decode(), grp))
    leased = _placed(tt, by_state.get(READY, []) + by_state.get(LEASED, []))
    for state in (PENDING, COMPUTING):
        for gkey, grp in by_state.get(state, []):
            _pending(tt, gkey, grp)
    _retired(tt, [(gkey, grp) for state in RETIRED for gkey, grp in by_state.get(state, [])])
    for db_name in ("items", "tombs", "order", "groups"):
        _clear(txn, dbs[db_name], prefix)
    tt.save()
    return {prefix.hex() + gkey: ref for gkey, ref in leased.items()}


def _under(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The rows of one database under a table's prefix, read before any is changed."""
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        rows = []
        while found and cur.key().startswith(prefix):
            rows.append((bytes(cur.key()), bytes(cur.value())))
            found = cur.next()
    return iter(rows)


def _clear(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> None:
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            found = cur.delete()


def _member(uid: str, rec: ItemRecord) -> Member:
    return Member(
        uid, rec.digest, rec.size, rec.seq, rec.created, rec.step, rec.response_length, rec.generated,
        rec.version, rec.reward, rec.priority, rec.advantage, rec.shaped_reward, rec.segments,
    )  # fmt: skip


def _members(tt: TableState, grp: GroupRecord) -> list[tuple[Member, int]]:
    """A group's members' rows, each with its deliveries, from their records or tombstones (a member
    deleted has neither, and is left out)."""
    found = []
    for uid in grp.members:
        raw = tt.txn.get(tt.key(uid), db=tt.db["items"]) or tt.txn.get(tt.key(uid), db=tt.db["tombs"])
        if raw is not None:
            rec = ItemRecord.decode(raw)
            found.append((_member(uid, rec), rec.times_sampled))
    return found


def _group(gkey: str, grp: GroupRecord, members: Sequence[Member]) -> Group:
    return Group(gkey, grp.created, members, grp.priority, grp.version, grp.partial, tuple(grp.failed.items()))


def _placed(tt: TableState, groups: list[tuple[str, GroupRecord]]) -> dict[str, GroupRef]:
    """Ready and leased (or cooling) groups written at their places in the ready order, groups at
    consecutive places sharing segments; returns the leased ones' places."""
    groups.sort(key=lambda pair: pair[1].ready_seq)
    after = tt.counters.next_rseq
    for _, run in itertools.groupby(enumerate(groups), key=lambda pair: pair[1][1].ready_seq - pair[0]):
        part = [pair for _, pair in run]
        for state in (READY, LEASED):  # consecutive in one state
            same = [(gkey, grp) for gkey, grp in part if grp.state == state]
            for _, chunk in itertools.groupby(enumerate(same), key=lambda pair: pair[1][1].ready_seq - pair[0]):
                at = [pair for _, pair in chunk]
                read = [_members(tt, grp) for _, grp in at]
                tt.counters.next_rseq = at[0][1].ready_seq  # segments.write places them from here on
                made = [_group(gkey, grp, [m for m, _ in rows]) for (gkey, grp), rows in zip(at, read, strict=True)]
                times = [max((t for _, t in rows), default=0) for rows in read]
                segments.write(tt, made, state, times=times, indexed=False)
    tt.counters.next_rseq = after
    leased = {}
    states = Segments(tt)
    cooling: dict[str, float] = {}
    for gkey, grp in groups:
        if grp.state != LEASED:
            continue
        ref = directory_entry(tt.txn.get(tt.key(gkey), db=tt.db["gdir"]) or b"")
        assert isinstance(ref, GroupRef)
        states.changed(ref.seg).set_lease(ref.group, bytes.fromhex(grp.lease) if grp.lease else NO_LEASE)
        if grp.lease:
            leased[gkey] = ref
        else:
            cooling[gkey] = grp.priority
    states.save()
    for key, _ in _under(tt.txn, tt.db["cooling"], tt.prefix):  # its new priority, a rows table's cooling row
        priority = cooling.get(key[12:].decode())
        if priority is not None:
            tt.txn.put(key, COOLING_PRIORITY.pack(priority), db=tt.db["cooling"])
    return leased


def _pending(tt: TableState, gkey: str, grp: GroupRecord) -> None:
    """A pending or computing group as a head with its members' rows (row_pending.keep), in the pending
    index or the compute queue where its record was."""
    members = [m for m, _ in _members(tt, grp)]
    row_pending.keep(tt, gkey, row_pending.PendingGroup(gkey, None, 0, grp.failed, grp.created), members)
    if grp.state == COMPUTING:
        head = row_pending.head(tt, gkey)
        assert head is not None
        tt.txn.delete(tt.pending_key(gkey, head), db=tt.db["pending"])
        head.queued, head.partial, head.placed = grp.ready_seq, grp.partial, (grp.priority, grp.version)
        tt.txn.put(tt.key(gkey), head.encode(), db=tt.db["gdir"])


def _retired(tt: TableState, groups: list[tuple[str, GroupRecord]]) -> None:
    """Retired groups written in retired segments at new places, those retired together together,
    each retired when it was (its retired index row's time), a quarantined member flagged so."""
    when: dict[str, float] = {}
    for key, _ in _under(tt.txn, tt.db["retired"], tt.prefix):
        when[key[12:].decode()] = int.from_bytes(key[4:12], "big") / 1e6
    _clear(tt.txn, tt.db["retired"], tt.prefix)
    by_time: dict[tuple[float, State], list[Group]] = {}
    quarantined: set[str] = set()
    for gkey, grp in groups:
        members = []
        for uid in grp.members:
            raw = tt.txn.get(tt.key(uid), db=tt.db["tombs"]) or tt.txn.get(tt.key(uid), db=tt.db["items"])
            if raw is not None:
                rec = ItemRecord.decode(raw)
                if rec.state == QUARANTINED:
                    quarantined.add(uid)
                members.append(_member(uid, rec))
        by_time.setdefault((when.get(gkey, 0.0), grp.state), []).append(_group(gkey, grp, members))
    for (at, state), made in sorted(by_time.items(), key=lambda item: item[0][0]):
        tt.now = at
        segments.write(tt, made, state, quarantined=quarantined)
    tt.now = 0.0


def _leases(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], tables: set[int], places: dict[str, GroupRef]
) -> None:
    """Each lease of groups of a table made rows becomes a lease of runs naming the same groups in the
    same order (a group left since is left out: a rows lease finds a group under it by its tag)."""
    for key, raw in list(txn.cursor(db=dbs["leases"])):
        lease = decode_lease(raw)
        if not isinstance(lease, Lease) or lease.table_id not in tables:
            continue
        prefix = layout.table_prefix(lease.table_id).hex()
        runs: list[RunRow] = []
        for gkey in lease.groups:
            ref = places.get(prefix + gkey)
            if ref is None:
                continue
            last = runs[-1] if runs else None
            if last is not None and last.seg == ref.seg and last.first + last.length == ref.group:
                runs[-1] = RunRow(last.seg, last.first, last.length + 1)
            else:
                runs.append(RunRow(ref.seg, ref.group, 1))
        row = RowLease(
            table_id=lease.table_id,
            runs=runs,
            expires=lease.expires,
            owner=lease.owner,
            counted=lease.counted,
            deferred=lease.deferred,
        )
        txn.put(bytes(key), row.encode(), db=dbs["leases"])
