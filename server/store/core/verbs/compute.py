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
from ...schema.states import COMPUTING, READY
from ...schema.table_config import TableConfig, estimator_of
from ...schema.views import Members, MemberView
from ..ordering.ready import Row
from ..table_state import rate_counts
from ..table_state.counters import read_counters
from ..table_state.read_check import payload_problem
from ..table_state.state import TableState, missing, stored
from ..table_state.views import group_record, member_record


def backlog(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    table_of: Callable[[int], tuple[str, TableConfig] | None],
    after: int,
    limit: int,
    damaged: dict[str, list[str]],
    lost: dict[str, list[str]],
) -> tuple[list[ComputeJob], int]:
    """Queued groups, oldest first within each table, up to about `limit` experiences, as one
    job per table, starting with the first table with a backlog after table id `after` (the
    caller passes the returned table id, the last job's, next time: tables take turns being first). The
    queue is read from table to table with a backlog, never over the tables without one.
    Payloads are read only for estimators that need token-level data, each checked against its
    digest: a group with a damaged one is left out, its damaged members' uids listed by table in
    `damaged` (for the caller to quarantine); the others work from the item records. A group with
    a member whose record the directory lost is left out too, its key listed by table in `lost`
    (for the caller to fail). `table_of` names a table id's table, None for a dropped one."""
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
                    table=name, config=config, groups=[], members=[], records={}, blobs={}, moments=moments
                )
                token_level = estimator_of(config).token_level
                while found and cur.key().startswith(prefix) and count < limit:
                    gkey = cur.value()
                    grp = GroupRecord.decode(stored(txn, prefix + gkey, dbs["groups"], "group"))
                    records: dict[str, MemberView] = {}
                    blobs: dict[str, Stored] = {}
                    for uid in grp.members:
                        item_key = prefix + uid.encode()
                        raw = txn.get(item_key, db=dbs["items"])
                        if raw is None:
                            lost.setdefault(name, []).append(gkey.decode())
                            break
                        records[uid] = ItemRecord.decode(raw)
                        if token_level:
                            payload = chunk_reads.read_payload(txn, dbs, item_key)
                            if payload is None:
                                raise missing("payload of experience", uid)
                            blobs[uid] = payload
                    whole_group = len(records) == len(grp.members)  # else a record is lost
                    bad = [
                        uid
                        for uid, blob in blobs.items()
                        if whole_group and payload_problem(uid, records[uid], blob) is not None
                    ]
                    if bad:
                        damaged.setdefault(name, []).extend(bad)
                    elif whole_group:
                        job.groups.append(gkey.decode())
                        job.members.append(grp.members)
                        job.records |= records
                        job.blobs |= {uid: bytes(whole(blob)) for uid, blob in blobs.items()}
                    count += len(grp.members)
                    found = cur.next()
                if job.groups:
                    jobs.append(job)
                after = table_id
            found = cur.set_range(layout.table_prefix(table_id + 1)) or cur.first()
    return jobs, after


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
            rec, value = member_record(view), advantages[uid]
            if shaping is not None and uid in shaping.rewards:
                rec.shaped_reward = shaping.rewards[uid]
            if isinstance(value, float):
                rec.advantage = value
            else:
                tt.txn.put(tt.key(uid), value, db=tt.db["adv"])
    tt.set_states(groups, READY)
    rate_counts.became_ready(tt, sum(len(recs) for _, _, recs in groups))
    placed = [(gkey, group_record(grp)) for gkey, grp, _ in groups]
    return [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in placed]
