"""The checks of a table's records (`expbuf check`, `verify()`, a full check at open): every
group and item record decodes and is where its state puts it (a live one's payload present, a
compact tombstone in tombs), every member is its group's, the pending, compute, retired and ready
indexes and the insertion order hold exactly what the records say, and the counters count what is
there. tables/integrity.py adds the directory's own checks and the other rooms' (chunk sets, rollouts
held in pieces, keyed values, shared prompts, the prompt ledger).
"""

from __future__ import annotations

from collections import defaultdict

from expbuf.client.trxp.stored.pieces import Stored

from ...disk import chunk_reads, layout
from ...disk.layout import u64
from ...disk.records import GroupRecord, ItemRecord
from ...disk.rows import (
    REF,
    GroupRef,
    Member,
    PendingHead,
    RowLease,
    RunRow,
    SegmentView,
    SegState,
    agreeing,
    decode_lease,
    decode_member_rows,
    directory_entry,
    fragment_key,
    uid_hash,
)
from ...schema.errors import DAMAGE
from ...schema.states import COMPUTING, FAILED, LEASED, LIVE, PENDING, QUARANTINED, READY, RETIRED, STATES, State
from ..table_state import oldest_index
from ..table_state.read_check import payload_problem, stored_problem
from ..table_state.state import TableState, member_state
from ..table_state.views import kept_rows, quarantined

_NO_TAG = "00" * SegState.LEASE  # a rows table's group under no lease


def records(tt: TableState) -> list[str]:
    """The problems of one table's records, their indexes and its counters; [] when consistent."""
    if tt.config.storage.layout == "rows":
        return rows(tt)
    problems: list[str] = []
    p, txn, db = tt.prefix, tt.txn, tt.db
    counts: dict[str, int] = defaultdict(int)
    groups: dict[str, GroupRecord] = {}
    retired: set[bytes] = set()  # the retired index's keys of the groups the tombstones are in
    naming: dict[str, int] = defaultdict(int)  # pending or computing members, by their group that has no record
    with txn.cursor(db=db["groups"]) as cur:
        found = cur.set_range(p)
        while found and cur.key().startswith(p):
            try:
                groups[cur.key()[4:].decode()] = GroupRecord.decode(cur.value())
            except DAMAGE as exc:
                problems.append(f"group record {bytes(cur.key()[4:])[:80]!r} does not decode ({exc})")
            found = cur.next()
    for name in ("items", "tombs"):
        with txn.cursor(db=db[name]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                try:
                    uid, rec = cur.key()[4:].decode(), ItemRecord.decode(cur.value())
                except DAMAGE as exc:
                    problems.append(f"item record {bytes(cur.key()[4:])[:80]!r} does not decode ({exc})")
                else:
                    if rec.group not in groups and rec.state in (PENDING, COMPUTING):
                        naming[rec.group] += 1
                    problems.extend(_check_form(tt, uid, rec, name, ItemRecord.compact(cur.value())))
                    problems.extend(_check_item(tt, uid, rec, groups.get(rec.group), counts, kept=name == "items"))
                    if rec.state in RETIRED:
                        retired.add(tt.retired_key(rec.group, rec.retired or 0.0))
                found = cur.next()
    problems.extend(_recordless(tt, groups, naming))
    ready = []  # every ready group, as the indexes of the orders hold it
    for gkey, grp in groups.items():
        if grp.state in LIVE:
            counts["groups_" + grp.state] += 1
        if grp.state == COMPUTING and txn.get(tt.rseq_key(grp), db=db["compute"]) != gkey.encode():
            problems.append(f"computing group {gkey} is missing from the compute queue")
        if grp.state == READY:
            ready.append((gkey.encode(), grp.ready_seq, grp.priority, grp.version))
        if grp.state == PENDING and txn.get(tt.pending_key(gkey, grp), db=db["pending"]) is None:
            problems.append(f"pending group {gkey} is missing from the timeout index")
    retired |= _memberless_marks(tt, {gkey for gkey, grp in groups.items() if grp.state in RETIRED and not grp.members})
    for key in sorted(retired):
        if txn.get(key, db=db["retired"]) is None:
            problems.append(f"retired group {key[12:].decode()} is missing from the retired index")
    if _prefix_count(tt, "retired") != len(retired):
        problems.append(f"the retired index holds {_prefix_count(tt, 'retired')} of {len(retired)} retired groups")
    if _prefix_count(tt, "compute") != counts["groups_computing"]:
        problems.append(f"the compute queue holds {_prefix_count(tt, 'compute')} groups")
    problems.extend(tt.ready.verify(ready))
    stored = tt.counters.to_dict()
    for name in (*STATES, "bytes", *(f"groups_{state}" for state in LIVE)):
        if stored[name] != counts[name]:
            problems.append(f"counter {name} is {stored[name]} but {counts[name]} were found")
    live = sum(counts[state] for state in LIVE)
    if _prefix_count(tt, "order") != live:
        problems.append(f"the insertion order holds {_prefix_count(tt, 'order')} of {live} live items")
    return problems


def _check_form(tt: TableState, uid: str, rec: ItemRecord, db: str, compact: bool) -> list[str]:
    """A tombstone whose payload went is compact, in the tombs database; a live experience,
    or a failed one whose payload is kept (keep_failed, or its group failed for a quarantined
    member), keeps its full record in items."""
    key = tt.key(uid)
    if db == "tombs":
        if not compact or rec.state in LIVE:
            return [f"item {uid} is {rec.state}, but its record is among the compact tombstones (tombs)"]
        if tt.txn.get(key, db=tt.db["items"]) is not None:
            return [f"item {uid} has both a record and a tombstone"]
        return []
    if compact:
        return [f"item {uid} is {rec.state}: its compact tombstone belongs in tombs, not items"]
    if rec.state in RETIRED and not (rec.state == FAILED and tt.txn.get(key, db=tt.db["blobs"]) is not None):
        return [f"item {uid} is a {rec.state} tombstone kept in full, not compact"]
    return []


def _check_item(
    tt: TableState, uid: str, rec: ItemRecord, grp: GroupRecord | None, counts: dict[str, int], *, kept: bool
) -> list[str]:
    """One item against its payload, group and place in the insertion order; `kept`: its full
    record is in items, where a failed one keeps its payload (_check_form)."""
    problems = []
    state = member_state(rec, grp)
    counts[state] += 1
    live = rec.state in LIVE
    blob = chunk_reads.read_payload(tt.txn, tt.db, tt.key(uid))
    if live != (blob is not None) and not (rec.state == FAILED and kept):
        problems.append(f"item {uid} is {rec.state} but its payload is {'missing' if live else 'present'}")
    if blob is not None:
        problem = payload_problem(uid, rec, blob)
        if problem is not None:
            problems.append(f"item {uid}: {problem}")
    if live:
        counts["bytes"] += rec.size
        if tt.txn.get(tt.prefix + u64(rec.seq), db=tt.db["order"]) != uid.encode():
            problems.append(f"item {uid} is missing from the insertion order")
    if grp is None and rec.state in (PENDING, COMPUTING):
        return problems  # its group's record is lost (_recordless names the group)
    if grp is None or uid not in grp.members:
        problems.append(f"item {uid} is not a member of its group {rec.group}")
    elif grp.state != state and not (state == QUARANTINED and grp.state in RETIRED):  # failed for it, or it was lost
        problems.append(f"item {uid} is {state} but its group {rec.group} is {grp.state}")
    return problems


def _recordless(tt: TableState, groups: dict[str, GroupRecord], naming: dict[str, int]) -> list[str]:
    """The pending or computing groups that the pending index, the compute queue or their members'
    records (`naming`: how many, by group) name without a group record that decodes: removable, as a
    rows table's whose head is lost (core/verbs/groups.py)."""
    found: dict[str, list[str]] = defaultdict(list)
    for what, gkeys in (
        ("the pending index", [key[8:] for key, _ in _rows_of(tt, "pending")]),
        ("the compute queue", [value for _, value in _rows_of(tt, "compute")]),
    ):
        for gkey in dict.fromkeys(name.decode(errors="replace") for name in gkeys):
            if gkey not in groups:
                found[gkey].append(what)
    for gkey, count in naming.items():
        found[gkey].append(f"{count} experience(s)")
    lost = "pending or computing group {!r}: its record is lost, {} naming it; " + REMOVE_DAMAGED
    return [lost.format(gkey[:80], " and ".join(whats)) for gkey, whats in found.items()]


def _memberless_marks(tt: TableState, gkeys: set[str]) -> set[bytes]:
    """The retired index's keys of retired groups without members (runs all reported failed,
    their tombstones the groups' records alone); a key of one missing from the index, one that
    says it is, at time 0."""
    found: dict[str, bytes] = {}
    if gkeys:
        with tt.txn.cursor(db=tt.db["retired"]) as cur:
            present = cur.set_range(tt.prefix)
            while present and cur.key().startswith(tt.prefix):
                gkey = bytes(cur.key()[12:]).decode(errors="replace")
                if gkey in gkeys:
                    found[gkey] = bytes(cur.key())
                present = cur.next()
    return {found.get(gkey) or tt.retired_key(gkey, 0.0) for gkey in gkeys}


def _prefix_count(tt: TableState, name: str) -> int:
    n = 0
    with tt.txn.cursor(db=tt.db[name]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            n += len(cur.key()) > len(tt.prefix)
            found = cur.next()
    return n


# The databases a rows table keeps nothing in (disk/rows/ keeps what they hold for a records table).
RECORDS_ONLY = ("items", "tombs", "groups", "order")


# How a pending or computing group whose head does not decode is removed (core/verbs/rows/deletes.py).
REMOVE_DAMAGED = "a pending group's: `expbuf repair`, or a Delete naming the group, removes it"


def rows(tt: TableState) -> list[str]:
    """The problems of a rows table's rows (issue 64): every segment decodes with its state, each of
    its groups has the directory entry that names it (but a group deleted whole, which none names) and
    no entry names another place, each live member's payload (but a deleted one's) is present and the
    one pushed, each ready group is covered by one ready run and every run covers ready groups of a
    segment, each pending group's head has its fragments and its row in the pending index
    (`_pending`), the index of the oldest holds each live segment's and pending group's oldest member
    (`_oldest`), nothing is kept in the records' databases, and the counters count what is there."""
    problems: list[str] = []
    counts: dict[str, int] = defaultdict(int)
    covered: dict[tuple[int, int], int] = defaultdict(int)  # (seg, group) -> the runs covering it
    places: dict[str, GroupRef] = {}
    heads: dict[str, PendingHead] = {}
    for key, value in _rows_of(tt, "gdir"):
        try:
            entry = directory_entry(value)
        except DAMAGE as exc:
            way_out = "" if value[:1] == bytes([REF]) else f"; {REMOVE_DAMAGED}"
            problems.append(f"group directory entry {key[:80]!r} does not decode ({exc}){way_out}")
            continue
        if isinstance(entry, PendingHead):
            heads[key.decode(errors="replace")] = entry
        else:
            places[key.decode(errors="replace")] = entry
    oldest: set[bytes] = set()  # the keys the index of the oldest should hold, the prefix taken off
    problems.extend(_pending(tt, heads, counts, oldest))
    for key, value in _rows_of(tt, "runs"):
        place = int.from_bytes(key, "big")
        try:
            run = RunRow.decode(value)
        except DAMAGE as exc:
            problems.append(f"ready run {place} does not decode ({exc})")
            continue
        if place != run.seg + run.first:  # a take looks for a group's run by its place
            problems.append(
                f"run keyed at {place} is of group {run.first} of segment {run.seg}, "
                f"whose place is {run.seg + run.first}"
            )
        for g in range(run.first, run.first + run.length):
            covered[run.seg, g] += 1
    leased: dict[tuple[int, int], str] = {}  # (seg, group) -> the lease of runs naming it
    for key, value in tt.txn.cursor(db=tt.db["leases"]):
        try:
            lease = decode_lease(value)
        except DAMAGE:
            continue  # the directory's own check reports it (leases.undecodable)
        if isinstance(lease, RowLease) and lease.table_id == tt.table_id:
            leased.update(
                ((run.seg, g), bytes(key).decode())
                for run in lease.runs
                for g in range(run.first, run.first + run.length)
            )
    retired = {key: None for key, _ in _rows_of(tt, "retired")}  # when each retired segment retired
    cooling = {key[8:].decode(errors="replace"): value for key, value in _rows_of(tt, "cooling")}  # replayed groups
    problems.extend(
        f"the cooling row of group {gkey} holds {len(value)} bytes, not a priority's 8"
        for gkey, value in cooling.items()
        if len(value) != 8
    )
    # the ready groups as the indexes the table keeps hold them (each at its place), which hold
    # exactly these (and the indexes it does not keep, nothing: ReadyIndex.verify)
    ready: list[tuple[bytes, int, float, int | None]] = []
    for key, value in _rows_of(tt, "segs"):
        seg = int.from_bytes(key, "big")
        raw_state = tt.txn.get(tt.prefix + key, db=tt.db["sstate"])
        try:
            view = SegmentView(value)
            if raw_state is None:
                raise ValueError("it has no state row")
            view, state = agreeing(view, SegState.decode(raw_state))
        except DAMAGE as exc:
            problems.append(f"segment {seg} does not decode ({exc})")
            continue
        when = oldest_index.in_segment(view, state)
        if when is not None:
            oldest.add(oldest_index.segment_key(b"", when, seg))
        for g, gkey in enumerate(view.keys(0, view.groups)):
            group_state = state.state(g)
            lo, hi = view.span(g)
            kept = state.kept(lo, hi)
            if hi > lo and not kept:  # deleted whole: its key is free (or a group pushed since holds it)
                if places.get(gkey) == GroupRef(seg, g):
                    del places[gkey]
                    problems.append(f"group {gkey} of segment {seg} was deleted but its directory entry names it")
            elif places.pop(gkey, None) != GroupRef(seg, g):
                problems.append(f"group {gkey} of segment {seg} has no directory entry naming it")
            if (group_state == READY) != (covered.pop((seg, g), 0) == 1):
                problems.append(f"group {gkey} is {group_state} but covered by another count of ready runs")
            if group_state == READY:
                ready.append((gkey.encode(), seg + g, view.priorities(g, g + 1)[0], view.versions(g, g + 1)[0]))
            tag = state.lease(g).hex()
            if not _lease_holds(group_state, tag, leased.pop((seg, g), None), gkey in cooling):
                problems.append(f"group {gkey} is {group_state} under lease {tag}, which does not hold it so")
            flagged = quarantined(view, state, g)
            counts[group_state] += len(kept) - len(flagged)
            counts[QUARANTINED] += len(flagged)
            live = group_state in LIVE
            if live:
                counts["groups_" + group_state] += 1
            for member in kept_rows(state, view.members.members(lo, hi), lo):
                blob = chunk_reads.read_payload(tt.txn, tt.db, tt.key(member.uid))
                if not live:
                    now = QUARANTINED if member.uid in flagged else group_state
                    if blob is not None and now != FAILED:  # a failed group's may be kept, for Get
                        problems.append(f"item {member.uid} of group {gkey} is {now} but its payload is kept")
                    elif blob is not None and (problem := _row_payload(member, FAILED, blob)) is not None:
                        problems.append(problem)
                    continue
                counts["bytes"] += member.size
                problem = _row_payload(member, READY if group_state == LEASED else group_state, blob)
                if problem is not None:
                    problems.append(problem)
        if all(s in RETIRED for s in state.states(0, state.groups)) != (state.retired is not None):
            problems.append(f"segment {seg} says it retired at {state.retired}, which its groups' states do not")
        if state.retired is not None and retired.pop(layout.micros(state.retired) + u64(seg), False) is not None:
            problems.append(f"segment {seg} retired at {state.retired} but the retired index does not name it so")
    problems.extend(
        f"directory entry of group {gkey} names segment {ref.seg}, which lacks it" for gkey, ref in places.items()
    )
    problems.extend(f"a ready run covers group {g} of segment {seg}, which is not there" for seg, g in covered)
    problems.extend(
        f"lease {lease} names group {g} of segment {seg}, which is not there"
        for (seg, g), lease in leased.items()
        if tt.txn.get(tt.prefix + u64(seg), db=tt.db["sstate"]) is not None  # one forgotten: its groups left
    )
    problems.extend(
        f"the retired index names segment {int.from_bytes(key[8:], 'big')}, not retired then" for key in retired
    )
    problems.extend(f"a rows table keeps records in {name}" for name in RECORDS_ONLY if _prefix_count(tt, name))
    problems.extend(_oldest(tt, oldest))
    problems.extend(tt.ready.verify(ready))
    stored = tt.counters.to_dict()
    for name in (*STATES, "bytes", *(f"groups_{state}" for state in LIVE)):
        if stored[name] != counts[name]:
            problems.append(f"counter {name} is {stored[name]} but {counts[name]} were found")
    return problems


def _pending(tt: TableState, heads: dict[str, PendingHead], counts: dict[str, int], oldest: set[bytes]) -> list[str]:
    """The problems of a rows table's pending and computing groups (core/verbs/rows/pending.py), their
    members counted and their keys in the index of the oldest added to `oldest`: each head's fragments
    and its own rows decode and hold the members its hashes name, in order, each payload present and the one pushed;
    the pending index names each pending head once, at its creation time, and the compute queue each
    computing head at its place; no fragment is of no head."""
    problems: list[str] = []
    fragments = {bytes(key): None for key, _ in _rows_of(tt, "frags")}
    indexed = {bytes(key) for key, _ in _rows_of(tt, "pending")}
    queued = {bytes(key): bytes(value).decode(errors="replace") for key, value in _rows_of(tt, "compute")}
    for gkey, head in heads.items():
        state = head.state
        counts["groups_" + state] += 1
        members = []
        try:
            for number in range(head.fragments):
                key = fragment_key(b"", gkey, number)
                raw = tt.txn.get(tt.prefix + key, db=tt.db["frags"])
                if fragments.pop(key, False) is not None or raw is None:
                    raise ValueError(f"its fragment {number} is not stored")
                members.extend(decode_member_rows(raw))
            members.extend(head.inline_rows())
        except DAMAGE as exc:
            problems.append(f"pending group {gkey}: {exc}")
            continue
        if members:  # its first member (fragments are never written empty)
            oldest.add(oldest_index.head_key(b"", members[0].created, gkey))
        if [uid_hash(member.uid) for member in members] != head.hashes:
            problems.append(f"pending group {gkey}: its fragments and head hold other members than its head names")
        if head.queued is not None and queued.pop(u64(head.queued), None) != gkey:
            problems.append(f"computing group {gkey} is missing from the compute queue")
        if head.queued is None:  # a computing group's row there would be of no pending group
            pending_key = tt.pending_key(gkey, head)[len(tt.prefix) :]
            if pending_key not in indexed:
                problems.append(f"pending group {gkey} is not in the pending index")
            indexed.discard(pending_key)
        for member in members:
            counts[state] += 1
            counts["bytes"] += member.size
            problem = _row_payload(member, state, chunk_reads.read_payload(tt.txn, tt.db, tt.key(member.uid)))
            if problem is not None:
                problems.append(problem)
    named = {"its fragments": [key[:-5] for key in fragments], "the pending index": [key[8:] for key in indexed]}
    named["the compute queue"] = [gkey.encode() for gkey in queued.values()]
    named["the index of the oldest"] = [oldest_index.group_of(key) for key, _ in _rows_of(tt, "oldest")]
    headless = _headless(tt, named)
    problems.extend(f"fragment {key[:80]!r} is of no pending group" for key in fragments if key[:-5] not in headless)
    problems.extend(
        f"the pending index names {key[8:80]!r}, which is not pending" for key in indexed if key[8:] not in headless
    )
    problems.extend(
        f"the compute queue names {gkey[:80]!r}, which is not computing"
        for gkey in queued.values()
        if gkey.encode() not in headless
    )
    problems.extend(
        f"pending or computing group {gkey[:80]!r}: its head is lost, {' and '.join(whats)} naming it; {REMOVE_DAMAGED}"
        for gkey, whats in headless.items()
    )
    return problems


def _headless(tt: TableState, named: dict[str, list[bytes]]) -> dict[bytes, list[str]]:
    """The groups that what is left of a pending or computing group (`named`: by what holds their
    keys) names without a directory entry at all, each with what names it: its head is lost."""
    found: dict[bytes, list[str]] = {}
    for what, gkeys in named.items():
        for gkey in dict.fromkeys(gkeys):
            if gkey and tt.txn.get(tt.prefix + gkey, db=tt.db["gdir"]) is None:
                found.setdefault(gkey, []).append(what)
    return found


def _oldest(tt: TableState, expected: set[bytes]) -> list[str]:
    """The problems of a rows table's index of the oldest (core/table_state/oldest_index.py): it holds
    exactly the `expected` keys, one for each segment with a live member and each pending or computing
    group with a member, at its oldest live member's time. A directory opened read-only before its first
    open by this release (which builds the index) has none to check."""
    if "oldest" not in tt.db:
        return []
    kept = {key for key, _ in _rows_of(tt, "oldest")}
    problems = [f"the index of the oldest lacks {_oldest_key(key)}" for key in sorted(expected - kept)]
    problems.extend(
        f"the index of the oldest names {_oldest_key(key)}, whose oldest live member it is not"
        for key in sorted(kept - expected)
    )
    return problems


def _oldest_key(key: bytes) -> str:
    """A key of the index of the oldest (its prefix taken off), as a problem names it."""
    if len(key) < 9 or (key[8:9] == oldest_index.SEGMENT and len(key) != 17):
        return f"a key of {len(key)} bytes"
    what = f"segment {int.from_bytes(key[9:], 'big')}" if key[8:9] == oldest_index.SEGMENT else f"group {key[9:89]!r}"
    return f"{what} at {oldest_index.unstamp(key[:8])}"


def _row_payload(member: Member, state: State, blob: Stored | None) -> str | None:
    """Why a rows table's member in `state` has not the payload pushed, in the words of a records
    table's check (_check_item: `expbuf check` reads the same for either), or None when it has."""
    if blob is None:
        return f"item {member.uid} is {state} but its payload is missing"
    problem = stored_problem(member.uid, member.size, member.digest, blob)
    return None if problem is None else f"item {member.uid}: {problem}"


def _lease_holds(state: State, tag: str, named: str | None, cooling: bool) -> bool:
    """Whether a rows table's group in `state`, its lease tag `tag` (hex), is held as the lease of runs
    naming it (`named`: its id; None: none) says: a leased group's tag is the id of the lease that
    names it, or zero where it is cooling (`cooling`: the cooling index names it, core/verbs/rows/requeue.py)
    and no lease names it; any other group's tag is zero, and only a retired one may still be named
    (retired as trained, it left its lease, which goes on)."""
    if state == LEASED:
        return named == tag or (cooling and named is None and tag == _NO_TAG)
    return tag == _NO_TAG and (named is None or state in RETIRED)


def _rows_of(tt: TableState, name: str) -> list[tuple[bytes, bytes]]:
    """A table's rows in one of the rows' databases, the table's prefix taken off their keys."""
    return layout.rows_under(tt.txn, tt.db[name], tt.prefix)
