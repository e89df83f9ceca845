"""A batch taken, as records: the ready groups chosen in the request's order (`select`), their
payloads read and checked (`Payloads`), the batch's rows read from their records (`read_batch`,
each member's delivery counted in its record where its delivery counts it now), and a batch's
groups leased (`lease`). What a take is, step by step (the trainer's version, the rate limit, the
groups that cannot be served, the delivery), is tables/taking.py's.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from expbuf.client.trxp.stored.pieces import Stored

from ...disk import chunk_reads
from ...disk.batch_rows import BatchRows
from ...disk.kinds import Sampled
from ...disk.snapshot import Snapshot
from ...schema.sample_spec import TakeSpec
from ...schema.states import LEASED
from ...schema.views import Groups, GroupView, Members, MemberView
from ..table_state import picks
from ..table_state.read_check import Unservable, all_unservable, unservable
from ..table_state.state import TableState
from ..table_state.views import group_record, member_record
from .rows import select as row_select


def select(tt: TableState, spec: TakeSpec, rng: random.Random) -> tuple[list[tuple[str, GroupView]], int, list[str]]:
    """Ready groups in the request's order, until there are enough; their experiences; and the
    groups passed over on the way whose records are not stored (the directory lost them)."""
    chosen: list[tuple[str, GroupView]] = []
    lost: list[str] = []
    total = 0
    with contextlib.closing(tt.ready.candidates(spec.order, rng, spec.min_model_version)) as candidates:
        for gkey_raw in candidates:
            gkey = gkey_raw.decode()
            grp = tt.group(gkey)
            if grp is None:
                lost.append(gkey)
                continue
            chosen.append((gkey, grp))
            total += len(grp.members)
            if spec.filled(len(chosen), total):
                break
    return chosen, total, lost


def read_batch(
    tt: TableState,
    taken: Sequence[Members],
    payloads: Payloads,
    rows: BatchRows,
    batch: Sampled,
    *,
    counted: bool,
    masked: Callable[[MemberView], int] | None,
) -> None:
    """The batch's rows and lists, member by member, from their records and the payloads read;
    `masked` says how many of a member's tokens its delivery masks (None: none is). `counted`:
    each member's delivery is counted in its record now (a leased one's is when its lease ends)."""
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
            if masked is not None:
                batch.masked.append(masked(rec))
            if counted:
                record = member_record(rec)
                record.times_sampled += 1
                tt.put_item(uid, record)


def read_rows(
    picked: picks.Picks,
    keys: Sequence[bytes],
    gkeys: Sequence[str],
    payloads: Payloads,
    rows: BatchRows,
    batch: Sampled,
    *,
    masked: Callable[[MemberView], int] | None,
) -> None:
    """`read_batch` of a rows table's picked groups (`keys`, their members' payloads'; `gkeys`,
    each member's group), their columns read a range at a time: no view of a member made unless
    the delivery masks tokens or the table's batch stage reads them. A rows table's delivery is
    counted in its group's state."""
    spans = picked.spans()
    uids, lengths = spans.column("uid"), spans.column("response_length")
    batch.uids += uids
    batch.group_ids += gkeys
    batch.versions += spans.column("version")
    batch.rewards += spans.column("reward")
    batch.response_lengths += lengths
    batch.times_sampled += spans.per_member([times + 1 for times in picked.times()])
    batch.segments += spans.column("segments")
    if masked is not None:
        batch.masked += [masked(rec) for p in picked for rec in p.members.values()]
    rows.add_columns(
        keys, payloads.read_all(uids), spans.column("advantage"), lengths,
        spans.column("size"), lambda: [rec for p in picked for rec in p.members.values()],
    )  # fmt: skip


def lease(tt: TableState, chosen: Groups, taken: Sequence[Members], lease_id: str) -> None:
    """A batch's groups leased under `lease_id`: out of the ready indexes, under the lease."""
    records = [(gkey, group_record(grp)) for gkey, grp in chosen]
    tt.ready.remove_many([(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in records])
    for _, grp in records:
        grp.lease = lease_id
    tt.set_states(taken, LEASED)


class Payloads:
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
        # a batch check_columns read at once (its uids, their payloads), kept as the lists they are
        # until something asks for one alone: `read_all` of those very uids copies the list
        self._whole: tuple[Sequence[str], list[memoryview]] | None = None

    def check(self, grp: GroupView, recs: Mapping[str, MemberView]) -> list[Unservable]:
        """Read the payloads of a group's members (`recs`, those whose records are stored); the
        members that cannot be served (a deferred one: its advantage alone), a member whose record
        or payload is not stored as damaged (the directory lost it)."""
        problems = [Unservable(uid, self.tt.lost_why(uid), damaged=True) for uid in grp.members if uid not in recs]
        for uid, rec in recs.items():
            problem = self._check(uid, self.tt.key(uid), rec.seq, rec.digest, rec.size, rec.advantage)
            if problem is not None:
                problems.append(problem)
        return problems

    def check_columns(
        self,
        uids: Sequence[str],
        keys: Sequence[bytes],
        seqs: Sequence[int],
        digests: Sequence[bytes],
        sizes: Sequence[int],
        advantages: Sequence[float | None],
    ) -> list[tuple[int, Unservable]]:
        """`check` of experiences given as their records' columns (a rows table's, read a range at a
        time; `keys`, their payloads'): the index of each that cannot be served, and why. A payload
        the snapshot holds whole (most are) is read and checked here, any other as `check` reads it."""
        self._open_snapshot()
        self._remember()
        snapshot, newest, blobs, read = self.snapshot, self.newest, self.tt.db["blobs"], self._read
        views = snapshot.get_all(keys, blobs) if snapshot is not None else [None] * len(keys)
        if chunk_reads.each_whole(views) and (not seqs or max(seqs) <= newest):  # mostly: checked at once
            stored = cast("list[memoryview]", views)  # each whole, so read
            self._whole = (uids, stored)
            return all_unservable(uids, advantages, sizes, digests, stored)
        whole = chunk_reads.all_whole(views)
        found: list[tuple[int, Unservable]] = []
        rows = zip(uids, keys, seqs, digests, sizes, advantages, views, whole, strict=True)
        for at, (uid, key, seq, digest, size, advantage, view, ok) in enumerate(rows):
            if ok and seq <= newest:
                read[uid] = view
                problem = unservable(uid, advantage, size, digest, view)
            else:
                problem = self._check(uid, key, seq, digest, size, advantage)
            if problem is not None:
                found.append((at, problem))
        return found

    def read(self, uid: str) -> Stored | chunk_reads.Deferred:
        """A payload `check` read."""
        self._remember()
        return self._read[uid]

    def read_all(self, uids: Sequence[str]) -> list[Stored | chunk_reads.Deferred]:
        """The payloads `check` or `check_columns` read of these experiences."""
        if self._whole is not None and uids is self._whole[0]:  # the batch read at once (a take's)
            return list(self._whole[1])
        self._remember()
        return list(map(self._read.__getitem__, uids))

    def _remember(self) -> None:
        """The batch read at once, if any, among the payloads read one by one."""
        if self._whole is not None:
            self._read.update(zip(*self._whole, strict=True))
            self._whole = None

    def _check(
        self, uid: str, key: bytes, seq: int, digest: bytes, size: int, advantage: float | None
    ) -> Unservable | None:
        blob = self._get(uid, key, seq, digest, size)
        if blob is None:
            return Unservable(uid, "its payload is not stored", damaged=True)
        return unservable(uid, advantage, size, digest, None if isinstance(blob, chunk_reads.Deferred) else blob)

    def _open_snapshot(self) -> None:
        """The snapshot opened at the first read, and the newest experience it holds."""
        if self.snapshot is None and self._open is not None:
            self.snapshot = self._open()
            if self.tt.config.storage.layout == "rows":
                self.newest = row_select.newest_seq(self.snapshot, self.tt)
            else:
                newest = self.snapshot.last_key(self.tt.prefix, self.tt.db["order"])
                self.newest = -1 if newest is None else int.from_bytes(newest[len(self.tt.prefix) :], "big")  # T + seq

    def _get(self, uid: str, key: bytes, seq: int, digest: bytes, size: int) -> Stored | chunk_reads.Deferred | None:
        self._open_snapshot()
        blobs = self.tt.db["blobs"]
        snapshot = self.snapshot if self.snapshot is not None and seq <= self.newest else None
        view = snapshot.get(key, blobs) if snapshot is not None else None
        if snapshot is not None and view is not None:
            read = chunk_reads.reader(snapshot, self.tt.db)
            if self._defer:
                blob = chunk_reads.taken(uid, view, key, digest, size, read)
            else:
                blob = chunk_reads.resolve(view, key, read)
        else:
            value = self.tt.txn.get(key, db=blobs)
            if value is None:
                return None
            blob = chunk_reads.resolve(value, key, chunk_reads.reader(self.tt.txn, self.tt.db))
        self._remember()
        self._read[uid] = blob
        return blob
