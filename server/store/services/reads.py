"""Reads of stored experiences by uid (Get, `expbuf export`) or by page (ListExperiences).

Reading is verifying: each payload is checked against the digest taken at push before it is
returned, and one that does not match is quarantined (quarantine.py, in the writer's
transaction, through `quarantine`) and left out, as is an experience that cannot be served
(read_check.py) or whose record the directory lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from expbuf.client.schema.balance import ModelShape, split_groups
from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.codec.build import build
from expbuf.client.trxp.codec.common import RawItem
from expbuf.client.trxp.stored.columns import Shares
from expbuf.client.trxp.stored.pieces import Stored, whole
from expbuf.client.trxp.varints import field_bytes

from ..core.table_state.counters import read_counters
from ..core.table_state.read_check import Unservable, payload_problem, serve_problem
from ..core.verbs.leases import lease_of
from ..core.whole_table import pages, reading
from ..disk import chunk_reads, digests, layout
from ..disk.chunk_reads import checked, read_payload
from ..disk.environment import Environment
from ..disk.kinds import Sampled
from ..disk.snapshot import Snapshot
from ..disk.stored_advantages import FinishBatch, batch_payload
from ..ledger.claimants import check_reader
from ..rules import partial_holds
from ..rules.staleness import masked_tokens, token_bound
from ..schema.errors import Busy, DamagedPiece, Forbidden, NotFound, TooLarge, clip, taken_with
from ..schema.table_config import batch_stage
from ..tables.catalog import TableCatalog

_FRAMING = 64 << 10  # what a GetReply adds to its payload and names, and more
log = logging.getLogger("expbuf.store")
OPEN_TRIES = 8  # read snapshots a ReadFields opens, each ended by later reads before it began
MAX_SPLITS = 64  # the splits of leased steps kept, for their other ranks' reads
SplitKey = tuple[int, str, int, str, ModelShape | None, bool]  # a table, lease, ranks, balance, model, equal


class Reads:
    """Reads over a data directory's environment and table catalog; `quarantine(table, uids)`
    quarantines those of uids whose payload is damaged (Store.quarantine), `finish` is the
    batch stage the server gave the store."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        quarantine: Callable[[str, Sequence[str]], int],
        finish: FinishBatch | None,
    ) -> None:
        self.environment, self.catalog, self._quarantine, self.finish = environment, catalog, quarantine, finish
        self._lock = threading.Lock()
        # The latest leases' splits, by group, and each group's members when it was split.
        self._splits: dict[SplitKey, tuple[list[list[str]], dict[str, list[str]]]] = {}
        self._reported = pages.Reported()  # the damage its reads logged: each once

    def _told(self, table: str, prefix: bytes) -> pages.Told:
        """Where a read of `table` (its key prefix) tells of the damage it passes over, once each."""
        return pages.Told(table, prefix, self._reported)

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads among uids (live experiences', and failed ones' kept for Get), each
        checked against its digest first: a damaged one is quarantined (quarantine.py), not returned."""
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        told = self._told(table, prefix)
        found: dict[str, bytes] = {}
        damaged: list[str] = []
        with self.environment.read() as txn:
            member = reading.members_of(txn, self.environment.db, prefix, config)
            for uid in uids:
                key = prefix + uid.encode()
                blob = read_payload(txn, self.environment.db, key)
                if blob is None:
                    continue
                rec = member(uid)
                if rec is None:
                    _servable(told, "Get", _lost(uid), [], damaged)
                    continue
                if payload_problem(uid, rec, blob) is None:
                    found[uid] = bytes(whole(blob))
                else:
                    damaged.append(uid)
        if damaged:
            self._quarantine(table, damaged)
        return found

    def partials(
        self,
        table: str,
        tids: Sequence[str],
        uids: Sequence[str] = (),
        limit: int = 0,
        *,
        alone: bool = False,
        holder: str = "",
    ) -> tuple[bytes, list[str]]:
        """A TRXP batch of the rollouts of tasks `tids` and of `uids` held in pieces, each put
        together as it stands and marked partial (rules/partial_holds.py), read from a snapshot, off the
        writer; with `limit`, as many as a reply of that many bytes holds with the names of the
        others, which are returned to ask for again. A first one too large for the reply comes
        `alone` (for a reply in parts), or is refused, TooLarge. With tokens on, `holder` reads a
        prompt's only while it holds the prompt's claim (ledger.check_reader). A rollout one of whose
        pieces is lost or damaged is left out and its pieces dropped (Store.quarantine), as a Get
        leaves out a damaged experience: its worker, finding nothing held, starts it over."""
        table_id, config = self.catalog.lookup(table)
        damaged: list[str] = []
        with self.environment.read() as txn:
            tt = self.catalog.state(txn, table_id, config)
            check_reader(tt, [*tids, *(uid_group_key(uid, "task") or uid for uid in uids)], holder)
            held = partial_holds.held(tt, tids, uids)
            budget = limit - _FRAMING - sum(len(uid.encode()) + 4 for uid, _ in held) if limit else 0
            items: list[RawItem] = []
            rest: list[str] = []
            for uid, size in held:
                if limit and (rest or size > budget) and (items or not alone):
                    rest.append(uid)
                    continue
                try:
                    items.append(partial_holds.so_far(tt, uid))
                except DamagedPiece:
                    damaged.append(uid)
                    continue
                budget -= size - len(uid.encode()) - 4
        if damaged:
            self._quarantine(table, damaged)
        if rest and not items:
            raise TooLarge(
                f"rollout {clip(rest[0])} held in pieces takes more than a reply of {limit} bytes carries; "
                "raise max_message_bytes on the server and the client, or read it with a client that takes "
                "replies in parts (get_partials of this release: ReadPartials with max_reply_bytes)"
            )
        return build(items), rest

    def page(
        self,
        table: str,
        *,
        states: Sequence[str] = (),
        min_version: int | None = None,
        max_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> pages.Page:
        """A page of the table's live experiences in insertion order (core/whole_table/pages.py)."""
        table_id, config = self.catalog.lookup(table)
        prefix, db = layout.table_prefix(table_id), self.environment.db
        filters, told = pages.Filters(set(states), min_version, max_version), self._told(table, prefix)
        if config.storage.layout == "rows":
            with self.environment.read(buffers=True) as views:  # its segments' columns read in place
                return pages.row_page(views, db, prefix, filters, after=after, limit=limit, told=told)
        with self.environment.read() as txn:
            return pages.page(txn, db, prefix, filters, after=after, limit=limit, told=told)

    def payload(self, table: str, uids: Sequence[str], limit: int | None = None) -> tuple[bytes, list[str]]:
        """A TRXP batch of the stored experiences among uids (in their order), and the missing
        uids. An experience that cannot be served (read_check.py) is never returned: it is
        listed as missing, and one whose payload is damaged is quarantined (quarantine.py).
        TooLarge as soon as the experiences read pass `limit` bytes, before the batch is made."""
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        told = self._told(table, prefix)
        missing: list[str] = []
        damaged: list[str] = []
        size = 0
        with self.environment.read(buffers=True) as txn:  # views, copied once: into the batch
            rows = reading.batch_rows(txn, self.environment.db, config, self.finish)
            member = reading.members_of(txn, self.environment.db, prefix, config)
            for uid in uids:
                key = prefix + uid.encode()
                blob = read_payload(txn, self.environment.db, key)
                if blob is None:
                    missing.append(uid)
                    continue
                rec = member(uid)
                if rec is None:
                    _servable(told, "Get", _lost(uid), missing, damaged)
                    continue
                if not _servable(told, "Get", serve_problem(uid, rec, blob), missing, damaged):
                    continue
                size += rec.size
                if limit is not None and size > limit:
                    raise TooLarge(
                        f"the experiences of {len(uids)} uids take more than {limit} bytes, more than one message: "
                        "ask for fewer, or read them with ReadFields (the clients' get), which sends them in parts"
                    )
                rows.add(key, rec, blob)
            stage = rows.stage(None)  # a Get is not a sample: its clip is not counted
            advantages = rows.advantages if stage is None else stage(rows.advantages)
            payload = batch_payload(checked(rows.blobs), advantages)
        if damaged:
            self._quarantine(table, damaged)
        if (
            limit is not None
            and field_bytes(len(payload)) + sum(field_bytes(len(uid.encode())) for uid in missing) > limit
        ):
            # the records' sizes were within it, but the batch adds each one's advantages and returns
            raise TooLarge(
                f"the experiences of {len(uids)} uids take {len(payload)} bytes with their advantages and returns, "
                f"more than one message of {limit} bytes: ask for fewer, or read them with ReadFields (the "
                "clients' get), which sends them in parts"
            )
        return payload, missing

    def fields(
        self,
        table: str,
        uids: Sequence[str],
        shares: Shares | None = None,
        *,
        whole: bool = False,
        step: Sequence[str] = (),
    ) -> tuple[Sampled, list[str]]:
        """The servable experiences among uids (in their order) as a batch to read some fields of
        (ReadFields; `shares` of their tokens, if given), or `whole` (its payload), and the missing
        uids. The payloads are views of a snapshot, off the writer, until the batch is released;
        one stored in chunks and read for some fields is read, and checked, where the reply is
        built, for only what the reply reads (chunk_reads.Deferred), the others here, and a damaged
        one quarantined and listed as missing, as Get lists it. `step`: the uids of the batch that
        uids are part of (a leased step, of which they are a rank's part), over which a table's
        batch stage finishes their advantages, as the step was sampled."""
        for _ in range(OPEN_TRIES):
            snapshot = self.environment.snapshot()  # on this thread: a read needs no writer's turn
            try:
                read = self._fields_from(snapshot, table, uids, shares, whole, step)
            except BaseException:
                snapshot.release()
                raise
            if read is not None:
                batch, missing, damaged = read
                if damaged:
                    self._quarantine(table, damaged)
                return batch, missing
        raise Busy(
            f"table '{table}': ReadFields could not hold a read snapshot: {OPEN_TRIES} in a row were ended by "
            "later reads before this one began; too many reads at once, read again"
        )

    def _fields_from(
        self,
        snapshot: Snapshot,
        table: str,
        uids: Sequence[str],
        shares: Shares | None,
        whole: bool,
        step: Sequence[str] = (),
    ) -> tuple[Sampled, list[str], list[str]] | None:
        """`fields` read from one snapshot, and the damaged uids; None if the snapshot was ended
        (detached by the writer, as too many were open) before this began to read it."""
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        told = self._told(table, prefix)
        db = self.environment.db
        batch = Sampled(uids=[], group_ids=[], blobs=[], snapshot=snapshot, shares=shares)
        missing: list[str] = []
        damaged: list[str] = []
        with snapshot.reading():
            if not snapshot.open:  # a map resize detached it before this began
                return None
            rows = reading.batch_rows(snapshot, db, config, self.finish)
            bound = None
            # Fields are delivered to a trainer, masked as a sample masks them; a whole payload (the
            # clients' get) is the experience as stored, as Get returns it.
            if config.staleness.token_bound is not None and not whole:  # the trainer's version, from the counters
                bound = token_bound(config, read_counters(snapshot, db, prefix).trainer_version)
            snapshot.hold(rows.blobs)
            snapshot.unpin()  # what it reads now goes into rows.blobs, held, under the lock
            member = reading.members_of(snapshot, db, prefix, config)  # its views copied out of the map
            for uid in uids:
                key = prefix + uid.encode()
                value = reading.payload_value(snapshot, db, key)
                if value is None:
                    missing.append(uid)
                    continue
                rec = member(uid)
                if rec is None:
                    _servable(told, "ReadFields", _lost(uid), missing, damaged)
                    continue
                chunk = chunk_reads.reader(snapshot, db)
                streamed = chunk_reads.streamed(value, key, chunk) if whole else None
                if streamed is not None:  # zstd frames: checked here one at a time, read again as the reply is cut
                    blob: Stored | chunk_reads.Deferred = chunk_reads.taken(
                        uid, value, key, rec.digest, rec.size, chunk
                    )
                    problem = serve_problem(uid, rec, None)
                    why = digests.differs(streamed[1], streamed[0], rec.size, rec.digest)
                    if problem is None and why is not None:
                        problem = Unservable(uid, why, damaged=True)
                else:
                    if whole:  # read and checked here, all of it, as Get checks it
                        blob = chunk_reads.resolve(value, key, chunk)
                    else:
                        blob = chunk_reads.taken(uid, value, key, rec.digest, rec.size, chunk)
                    problem = serve_problem(uid, rec, None if isinstance(blob, chunk_reads.Deferred) else blob)
                if not _servable(told, "ReadFields", problem, missing, damaged):
                    continue
                rows.add(key, rec, blob)
                batch.uids.append(uid)
                batch.group_ids.append(rec.group)
                batch.versions.append(rec.version)
                batch.rewards.append(rec.reward)
                batch.response_lengths.append(rec.response_length)
                batch.segments.append(rec.segments)
                if bound is not None:
                    batch.masked.append(masked_tokens(rec, bound))
            if batch_stage(config):  # the rest of the step, which its batch stage finishes these over
                read = set(uids)
                for uid in step:
                    rec = None if uid in read else member(uid)
                    if rec is not None:
                        rows.add_beside(prefix + uid.encode(), rec)
            batch.blobs, batch.advantages, batch.stage = rows.blobs, rows.advantages, rows.stage(None)
        return batch, missing, damaged

    def part(
        self,
        table: str,
        lease_id: str,
        rank: int,
        ranks: int,
        balance: str,
        model: ModelShape | None = None,
        owner: str = "",
        equal: bool = False,
    ) -> tuple[list[str], list[str], list[str]]:
        """The uids of rank `rank`'s part of the groups still held under `lease_id`, spread whole
        over `ranks` ranks by `balance` (schema/balance.py; `model` for "flops"; as many groups a
        rank with `equal`), in the lease's order; those of the whole step (every group still
        held under it, in its order), over which a table's batch stage finishes the part's
        advantages (`fields`'s `step`); and those of the part's groups that left the lease since
        it was split (a member found damaged failed its group), which its reads name as missing
        rather than leave out unsaid. NotFound when the table holds no such lease, Forbidden
        when another token than `owner`'s took it (with tokens on, as Ack and Renew check it)."""
        table_id, _ = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        db = self.environment.db
        key = (table_id, lease_id, ranks, balance, model, equal)
        with self.environment.read() as txn:
            lease = lease_of(txn, db, lease_id)
            if lease is None or lease.table_id != table_id:
                raise NotFound(
                    f"table '{table}' holds no lease {clip(lease_id)!r}: acked, given back, expired, or never "
                    "taken; sample the step again"
                )
            if lease.owner != owner:
                whose = taken_with(lease.owner, owner)
                also = "; read its parts with that one" if whose == "another token" else ""
                raise Forbidden(f"lease {clip(lease_id)!r} was taken with {whose}{also}")
            held = reading.lease_groups(txn, db, prefix, lease_id, lease)  # its groups still held, and their runs
            with self._lock:
                kept = self._splits.get(key)
            if kept is None:
                tokens = {
                    gkey: [_tokens_of(reading.payload_value(txn, db, prefix + uid.encode())) for uid in members]
                    for gkey, members in held.items()
                }
                kept = split_groups(tokens, ranks, balance, model, equal), {g: list(uids) for g, uids in held.items()}
                with self._lock:  # every rank of the step asks: the split is made once
                    self._splits[key] = kept
                    while len(self._splits) > MAX_SPLITS:
                        self._splits.pop(next(iter(self._splits)))
        split, members = kept
        part = [uid for gkey in split[rank] if gkey in held for uid in held[gkey]]
        gone = [uid for gkey in split[rank] if gkey not in held for uid in members[gkey]]
        return part, [uid for members in held.values() for uid in members], gone


def _servable(told: pages.Told, call: str, problem: Unservable | None, missing: list[str], damaged: list[str]) -> bool:
    """Whether a read experience can be served; one that cannot is listed as missing, and also as
    damaged (to quarantine) or logged (once: `told`), as a reason of its own keeps it from being served."""
    if problem is None:
        return True
    if problem.damaged:
        damaged.append(problem.uid)
    else:
        told.error(problem.uid, "%s found %s; it is not served", call, problem)
    missing.append(problem.uid)
    return False


def _lost(uid: str) -> Unservable:
    """A payload whose record the directory lost, or a damaged page left undecodable: not served
    (nothing says what it should be), and left for a sample of its group to quarantine
    (quarantine.py), which knows the group."""
    return Unservable(
        uid, "its payload is stored but its record is not stored or does not decode: run `expbuf check`", damaged=False
    )


def _tokens_of(value: bytes | memoryview | None) -> int:
    """A stored value's tokens for a split's cost: 0 for one that cannot be read, which its read finds."""
    return chunk_reads.token_length(value) or 0
