"""The compute queue: complete groups waiting for their advantages, in the order they
completed (the `compute` index, T + rseq -> group key). A group joins when it becomes computing
and leaves when its advantages are stored (`store_advantages`) or it leaves the table, rows the
table state writes as its groups move (core/table_state/state.py, retire.leave_indexes); the server's
advantage workers read it (`backlog`), table by table in turns."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lmdb

from expbuf.client.trxp.stored.pieces import Stored, whole

from ...disk import chunk_reads, layout
from ...disk.kinds import ComputeJob, ShapingUpdate
from ...disk.records import GroupRecord, ItemRecord
from ...disk.rows import PendingHead, directory_entry
from ...schema.errors import DAMAGE
from ...schema.states import COMPUTING, READY, State
from ...schema.table_config import TableConfig, estimator_of
from ...schema.views import Members, MemberView
from ..ordering.ready import Row
from ..table_state import rate_counts
from ..table_state.counters import read_counters
from ..table_state.pending_reads import missing, pending_rows, stored
from ..table_state.read_check import payload_problem
from ..table_state.state import TableState
from ..table_state.views import RowGroup, RowMember, group_record, member_record
from .rows import ends as row_ends


def backlog(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    table_of: Callable[[int], tuple[str, TableConfig] | None],
    after: int,
    limit: int,
    damaged: dict[str, list[str]],
    lost: dict[str, list[str]],
    unreadable: dict[str, dict[str, str]],
) -> tuple[list[ComputeJob], int]:
    """Queued groups, oldest first within each table, up to about `limit` experiences, as one
    job per table, starting with the first table with a backlog after table id `after` (the
    caller passes the returned table id, the last job's, next time: tables take turns being first). The
    queue is read from table to table with a backlog, never over the tables without one.
    Payloads are read only for estimators that need token-level data, each checked against its
    digest: a group with a damaged one is left out, its damaged members' uids listed by table in
    `damaged` (for the caller to quarantine); the others work from the item records (a rows table's
    from its computing groups' heads and fragments: row_ends.queue). A group with
    a member whose record the directory lost is left out too, its key listed by table in `lost`
    (for the caller to fail); one whose own record (a rows table's: its head) is lost or does not
    decode is passed over, listed by table in `unreadable` with why (for the caller to log: it
    names none of its members, and is left to `expbuf check`), so that it holds up no other group
    or table. `table_of` names a table id's table, None for a dropped one."""
    jobs: list[ComputeJob] = []
    count = 0
    seen: set[int] = set()
    with txn.cursor(db=dbs["compute"]) as cur:
        found = cur.set_range(layout.table_prefix(after + 1)) or cur.first()
        while found and count < limit:
            table_id = layout.table_of(cur.key())
            if table_id in seen:  # around to the first table again
                break
            seen.add(table_id)
            prefix = layout.table_prefix(table_id)
            table = table_of(table_id)
            if table is not None:
                name, config = table
                moments = read_counters(txn, dbs, prefix).reward_moments
                job = ComputeJob(
                    table=name,
                    config=config,
                    groups=[],
                    members=[],
                    records={},
                    blobs={},
                    moments=moments,
                    table_id=table_id,
                )
                token_level = estimator_of(config).token_level
                rows = config.storage.layout == "rows"
                while found and cur.key().startswith(prefix) and count < limit:
                    gkey = cur.value()
                    try:
                        uids, records = (_queued_rows if rows else _queued_records)(txn, dbs, prefix, bytes(gkey))
                    except DAMAGE as exc:
                        unreadable.setdefault(name, {})[bytes(gkey).decode(errors="replace")] = str(exc)
                        found = cur.next()
                        continue
                    whole_group = len(records) == len(uids)  # else a record is lost
                    if not whole_group:
                        lost.setdefault(name, []).append(gkey.decode())
                    blobs: dict[str, Stored] = {}
                    for uid in records if token_level and whole_group else ():
                        payload = chunk_reads.read_payload(txn, dbs, prefix + uid.encode())
                        if payload is None:
                            raise missing("payload of experience", uid)
                        blobs[uid] = payload
                    bad = [uid for uid, blob in blobs.items() if payload_problem(uid, records[uid], blob) is not None]
                    if bad:
                        damaged.setdefault(name, []).extend(bad)
                    elif whole_group:
                        job.groups.append(gkey.decode())
                        job.places.append(int.from_bytes(cur.key()[len(prefix) :], "big"))
                        job.members.append(uids)
                        job.records |= records
                        job.blobs |= {uid: bytes(whole(blob)) for uid, blob in blobs.items()}
                    count += len(uids)
                    found = cur.next()
                if job.groups:
                    jobs.append(job)
                after = table_id
            found = cur.set_range(layout.table_prefix(table_id + 1)) or cur.first()
    return jobs, after


def _queued_records(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes, gkey: bytes
) -> tuple[list[str], dict[str, MemberView]]:
    """A records table's computing group's members' uids and their records (one whose record the
    directory lost, or a damaged page left undecodable, is left out: those after it are not read)."""
    grp = GroupRecord.decode(stored(txn, prefix + gkey, dbs["groups"], "group"))
    records: dict[str, MemberView] = {}
    for uid in grp.members:
        raw = txn.get(prefix + uid.encode(), db=dbs["items"])
        try:
            rec = None if raw is None else ItemRecord.decode(raw)
        except DAMAGE:  # lost, as TableState.item reads it where the writer fails the group
            rec = None
        if rec is None:
            break
        records[uid] = rec
    return grp.members, records


def _queued_rows(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes, gkey: bytes
) -> tuple[list[str], dict[str, MemberView]]:
    """A rows table's computing group's members' uids and views, from its fragments and head; one some
    of whose rows damage lost (a fragment not stored or not decoding) has no views, so that the caller
    lists it as lost (its uids' hashes, as text, stand for its uids: a view of it in the writer's
    transaction names its members: TableState.pending_members)."""
    entry = directory_entry(stored(txn, prefix + gkey, dbs["gdir"], "group"))
    if not isinstance(entry, PendingHead):
        raise missing("computing group", gkey.decode())
    key = gkey.decode()
    try:
        rows = pending_rows(txn, dbs, prefix, key, entry)
    except Exception:  # a damaged page can make a row's decoder raise almost anything
        return [str(value) for value in entry.hashes], {}
    return [row.uid for row in rows], {row.uid: RowMember(row, key, COMPUTING) for row in rows}


def queue(tt: TableState, groups: Sequence[Members]) -> None:
    """Groups a push completed, left to the advantage worker: computing, in the queue."""
    tt.set_states(groups, COMPUTING)


def queued(tt: TableState) -> bool:
    """Whether any group of the table waits in the compute queue."""
    with tt.txn.cursor(db=tt.db["compute"]) as cur:
        return cur.set_range(tt.prefix) and cur.key().startswith(tt.prefix)


def store_advantages(
    tt: TableState,
    groups: Sequence[Members],
    advantages: dict[str, float | bytes],
    shaping: ShapingUpdate | None,
) -> list[Row]:
    """Groups' values stored and the groups made ready together; returns their ready index
    entries."""
    for _, _, views in groups:
        for uid, view in views.items():
            rec = member_record(view)
            shaped, advantage = _values(tt, uid, advantages, shaping)
            if shaped is not None:
                rec.shaped_reward = shaped
            if advantage is not None:
                rec.advantage = advantage
    tt.set_states(groups, READY)
    rate_counts.became_ready(tt, sum(len(recs) for _, _, recs in groups))
    placed = [(gkey, group_record(grp)) for gkey, grp, _ in groups]
    return [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in placed]


def still_queued(tt: TableState, gkey: str, place: int | None) -> bool:
    """Whether a computing group is the one a computation read: still at the `place` in the compute
    queue where it was read. A group deleted and pushed again meanwhile completed again, at another
    place: values computed for the group it was are not its own (whatever runs it has now), while one
    that only lost a member since is the same group."""
    return place is not None and tt.txn.get(tt.prefix + layout.u64(place), db=tt.db["compute"]) == gkey.encode()


def _values(
    tt: TableState, uid: str, advantages: dict[str, float | bytes], shaping: ShapingUpdate | None
) -> tuple[float | None, float | None]:
    """A member's shaped reward (where the shaping made one) and its advantage, if one float: a
    token-level one goes into the adv database here, the member's own field left as it is."""
    value = advantages[uid]
    shaped = None if shaping is None else shaping.rewards.get(uid)
    if isinstance(value, float):
        return shaped, value
    tt.txn.put(tt.key(uid), value, db=tt.db["adv"])
    return shaped, None


def store_row_advantages(
    tt: TableState,
    groups: Sequence[tuple[RowGroup, bool, bool]],
    advantages: dict[str, float | bytes],
    shaping: ShapingUpdate | None,
    was: State,
) -> None:
    """A rows table's groups' values (as `row_ends.complete` takes the groups: with whether each
    completes partial and was written) go into their members' rows, written once, into the segments
    the groups become ready in (token-level ones into the adv database, as a records table's)."""
    done = []
    for grp, partial, written in groups:
        rows = []
        for member in grp.rows:
            shaped, advantage = _values(tt, member.uid, advantages, shaping)
            if shaped is not None:
                member = member._replace(shaped_reward=shaped)
            if advantage is not None:
                member = member._replace(advantage=advantage)
            rows.append(member)
        done.append((grp._replace(rows=tuple(rows)), partial, written))
    row_ends.complete(tt, done, was)
