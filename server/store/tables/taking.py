"""Taking a batch of whole ready groups.

A batch is chosen in the request's order, whole groups only, optionally only groups
whose every member is at least `min_model_version` (found through the version index of
core/indexes.py, so stale groups in front cost nothing). It is delivered by consuming it
(payloads deleted in the same transaction), leasing it (invisible until acked; back on
nack or expiry), or replaying it (counted against max_times_sampled, lowered and cooled by
reuse.py). A Sample stream's batch is first held, whatever its delivery: leased without
expiry, invisible to others, until the client confirms it has the batch. A lease's life,
granted with the batch, is leases.py's.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
from collections.abc import Callable, Generator, Iterator

from expbuf.client.trxp.pieces import Stored

from ..core import rate_counts
from ..core.read_check import Unservable, serve_problem
from ..core.retire import retire
from ..core.state import TableState
from ..disk import chunk_reads
from ..disk.batch_rows import BatchRows
from ..disk.kinds import Sampled
from ..disk.records import Counted, GroupRecord, ItemRecord
from ..disk.snapshot import Snapshot
from ..disk.stored_advantages import FinishBatch, StageCounts
from ..rules import reuse
from ..rules.limiter import sample_limit
from ..rules.quarantine import quarantine_groups
from ..rules.staleness import masked_tokens, report, token_bound
from ..schema.errors import SampleLimited, SpecError
from ..schema.sample_spec import MAX_BATCH, SampleSpec
from ..schema.states import CONSUMED, FAILED, LEASED

log = logging.getLogger("expbuf.store")


def could_fill(tt: TableState, spec: SampleSpec, allow_partial: bool) -> bool:
    """Whether the table holds enough ready data for the request at all (whatever its
    versions): when not, no batch can be taken and nothing needs to be tried."""
    groups, experiences = tt.counters.groups_ready, tt.counters.ready
    if allow_partial:
        return groups > 0
    return bool((spec.num_groups and groups >= spec.num_groups) or (spec.batch_size and experiences >= spec.batch_size))


def take(
    tt: TableState,
    spec: SampleSpec,
    allow_partial: bool,
    rng: random.Random,
    *,
    hold: bool,
    snapshot: Callable[[], Snapshot] | None = None,
    finish: FinishBatch | None = None,
    counts: StageCounts | None = None,
) -> Sampled | SampleLimited | None:
    """Select and deliver one batch; None if there is not enough (and no partial batch),
    the rate limit (limiter.py) if it holds the batch back. The request's trainer version
    is stored first (staleness.py); the caller undoes it when no batch is taken. With
    `snapshot` (a way to open one), the payloads are views read from it, not copies (see
    _Payloads). The batch carries its stored advantages; a table's batch stage is left to
    run where the reply is built (`Sampled.stage`: `finish`, the server's, its clip counted in
    `counts`)."""
    report(tt, spec.trainer_version)  # before selection: a stale group is not taken in the same step
    payloads = _Payloads(tt, snapshot, defer=hold)
    while True:
        chosen, total = _select(tt, spec, rng)
        enough = (spec.num_groups and len(chosen) >= spec.num_groups) or (spec.batch_size and total >= spec.batch_size)
        if not chosen or not (enough or allow_partial):
            return None
        held = sample_limit(tt, total)
        if held is not None:
            return held
        taken = [(gkey, grp, tt.stored_members(grp)) for gkey, grp in chosen]
        unservable = [(gkey, grp, problems) for gkey, grp, recs in taken if (problems := payloads.check(grp, recs))]
        if not unservable:
            break
        _fail_unservable(tt, unservable)  # and choose again, from the groups left
        tt.save()  # the failure stands whether or not the groups left make a batch
    batch = Sampled(uids=[], group_ids=[], blobs=[], partial=not enough)
    delivery = "lease" if hold else spec.delivery
    if delivery == "lease":  # its record is the lease's life's to write (leases.py: Leases.grant)
        batch.lease_id = secrets.token_hex(8)
        batch.lease_expires = tt.now + spec.lease_seconds  # a held one's, were it confirmed as it is sent
    rows = BatchRows(tt.txn, tt.db["adv"], tt.config, finish)
    bound = token_bound(tt.config, tt.counters.trainer_version)
    for gkey, _, recs in taken:
        for uid, rec in recs.items():
            rows.add(tt.key(uid), rec, payloads.read(uid))
            batch.uids.append(uid)
            batch.group_ids.append(gkey)
            batch.versions.append(rec.version)
            batch.rewards.append(rec.reward)
            batch.response_lengths.append(rec.response_length)
            batch.times_sampled.append(rec.times_sampled + 1)
            batch.segments.append(rec.segments)
            if bound is not None:
                batch.masked.append(masked_tokens(rec, bound))
            if delivery != "lease":  # a leased one is counted in its record when the lease ends (leases.py)
                rec.times_sampled += 1
                tt.put_item(uid, rec)
    batch.blobs, batch.advantages, batch.stage = rows.blobs, rows.advantages, rows.stage(counts)
    batch.counted = Counted(len(batch.uids), sum(rec.size for rec in rows.records), sum(batch.masked))
    if delivery == "consume":
        retire(tt, chosen, CONSUMED)
    elif delivery == "replay":
        reuse.replayed(tt, taken, rng)
    elif delivery == "lease":
        tt.ready.remove_many([(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in chosen])
        for _, grp in chosen:
            grp.lease = batch.lease_id
        tt.set_states(taken, LEASED)
    tt.counters.sampled += batch.counted.experiences
    tt.counters.bytes_sampled += batch.counted.nbytes
    tt.counters.tokens_masked += batch.counted.tokens_masked
    rate_counts.taken(tt, batch.counted.experiences)
    batch.newest_version = tt.counters.max_version
    batch.trainer_version = tt.counters.trainer_version
    tt.extensions.on_sample(tt, chosen)
    tt.save()
    if payloads.snapshot is not None:
        batch.snapshot = payloads.snapshot
        payloads.snapshot.hold(batch.blobs)
        payloads.snapshot.unpin()
    return batch


def _closable(keys: Iterator[bytes]) -> Generator[bytes]:
    """`keys` as a generator: closing it closes them, and the cursors they read from."""
    yield from keys


def _select(tt: TableState, spec: SampleSpec, rng: random.Random) -> tuple[list[tuple[str, GroupRecord]], int]:
    """Ready groups in the request's order, until there are enough; and their experiences."""
    chosen = []
    total = 0
    with contextlib.closing(_closable(tt.ready.candidates(spec.order, rng, spec.min_model_version))) as candidates:
        for gkey_raw in candidates:
            gkey = gkey_raw.decode()
            grp = tt.existing_group(gkey)
            chosen.append((gkey, grp))
            total += len(grp.members)
            if (spec.num_groups and len(chosen) >= spec.num_groups) or (spec.batch_size and total >= spec.batch_size):
                break
            if total > MAX_BATCH:
                raise SpecError(
                    f"the first {len(chosen)} of the {spec.num_groups} groups asked for hold {total} experiences: a "
                    f"batch holds at most {MAX_BATCH} (its take holds the store's writer); ask for fewer groups a batch"
                )
    return chosen, total


def _fail_unservable(tt: TableState, groups: list[tuple[str, GroupRecord, list[Unservable]]]) -> None:
    """Groups a sample found a member of unservable fail whole, never served: one with a
    damaged payload by the quarantine rule (quarantine.py: the damaged members quarantined, the
    others' payloads kept for Get); one whose stored advantage is beyond float32 as any failed
    group (its payloads kept where the table keeps failed groups)."""
    damaged, beyond = [], []
    for gkey, grp, problems in groups:
        found = {problem.uid: problem.why for problem in problems if problem.damaged}
        for problem in problems:
            if not problem.damaged:
                log.error(
                    "table %s: group %s failed when sampled, never to be served: %s", tt.config.name, gkey, problem
                )
        if found:
            damaged.append((gkey, grp, found))
        else:
            beyond.append((gkey, grp))
            tt.counters.groups_failed += 1
            tt.counters.last_failure = f"group {gkey}: {problems[0]}"
    if damaged:
        quarantine_groups(tt, damaged)
    if beyond:
        retire(tt, beyond, FAILED)


class _Payloads:
    """Reads and checks the stored payloads of a batch being taken: from the snapshot, a
    view, for an experience that was stored before the snapshot's state (its insertion
    number is at most the newest in the snapshot's insertion order: it was committed then,
    and its payload has not changed since); a copy from the write for one stored in this
    very commit. The snapshot opens at the first read. With `defer` (a held batch, which a
    reply that cannot be built gives back), one stored in chunks is read from the snapshot, and
    checked, where its reply is built (chunk_reads.Deferred), not here in the writer."""

    def __init__(self, tt: TableState, open_snapshot: Callable[[], Snapshot] | None, *, defer: bool) -> None:
        self.tt, self._open, self._defer = tt, open_snapshot, defer
        self.snapshot: Snapshot | None = None
        self.newest = -1
        self._read: dict[str, Stored | chunk_reads.Deferred] = {}

    def check(self, grp: GroupRecord, recs: dict[str, ItemRecord]) -> list[Unservable]:
        """Read the payloads of a group's members (`recs`, those whose records are stored); the
        members that cannot be served (a deferred one: its advantage alone), a member whose record
        or payload is not stored as damaged (the directory lost it)."""
        problems = [Unservable(uid, "its record is not stored", damaged=True) for uid in grp.members if uid not in recs]
        for uid, rec in recs.items():
            blob = self._get(uid, rec)
            if blob is None:
                problems.append(Unservable(uid, "its payload is not stored", damaged=True))
                continue
            problem = serve_problem(uid, rec, None if isinstance(blob, chunk_reads.Deferred) else blob)
            if problem is not None:
                problems.append(problem)
        return problems

    def read(self, uid: str) -> Stored | chunk_reads.Deferred:
        """A payload `check` read."""
        return self._read[uid]

    def _get(self, uid: str, rec: ItemRecord) -> Stored | chunk_reads.Deferred | None:
        if self.snapshot is None and self._open is not None:
            self.snapshot = self._open()
            newest = self.snapshot.last_key(self.tt.prefix, self.tt.db["order"])
            self.newest = -1 if newest is None else int.from_bytes(newest[len(self.tt.prefix) :], "big")  # T + seq
        key, blobs = self.tt.key(uid), self.tt.db["blobs"]
        snapshot = self.snapshot if self.snapshot is not None and rec.seq <= self.newest else None
        view = snapshot.get(key, blobs) if snapshot is not None else None
        if snapshot is not None and view is not None:
            read = chunk_reads.reader(snapshot, self.tt.db)
            if self._defer:
                blob = chunk_reads.taken(uid, view, key, rec.digest, rec.size, read)
            else:
                blob = chunk_reads.resolve(view, key, read)
        else:
            value = self.tt.txn.get(key, db=blobs)
            if value is None:
                return None
            blob = chunk_reads.resolve(value, key, chunk_reads.reader(self.tt.txn, self.tt.db))
        self._read[uid] = blob
        return blob
