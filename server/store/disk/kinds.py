"""What goes into the store and what comes out of it: a validated experience ready to
store, the result of a push, a sampled batch, and a computation of advantages to do."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from expbuf.client.schema.experience import ids_of
from expbuf.client.schema.routing import GROUP_KEY_OF
from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.build import pack_item
from expbuf.client.trxp.codec.common import ITEMSIZE, RawItem, versions
from expbuf.client.trxp.stored.columns import (
    PREFIX_FIELDS,
    SCALARS,
    SEGMENTS,
    ColumnParts,
    Shares,
    in_order,
    scalar_column,
    segment_column,
)
from expbuf.client.trxp.stored.pieces import Run, Stored, concatenated

from ..schema.errors import BatchStageFailed, InvalidRequest, clip, stage_error
from ..schema.sample_spec import INT64
from ..schema.states import PENDING
from ..schema.table_config import TableConfig
from ..schema.views import MemberView
from . import digests
from .chunk_reads import Deferred, checked, token_length
from .records import Counted, ItemRecord
from .rows import Member
from .snapshot import Charge, Snapshot
from .stored_advantages import Advantage, Masks, Stage, batch_columns, batch_parts

T = TypeVar("T")

_NEW = object.__new__  # an instance with its slots unset, for `Entry.staged` to set each

# Whether pushes may wait for room now (asked before they first would): None if they may, else why not.
MayWait = Callable[[], str | None]


@dataclass(slots=True)
class Entry:
    """One validated experience ready to store: its identity and one-item payload.

    Not changed once made; not frozen, as a frozen dataclass's construction costs a push
    about a microsecond an experience more."""

    uid: str
    tid: str
    rid: str
    sid: str
    blob: bytes  # the one-item payload, or the head of one whose section a push staged or was compressed (chunked.py)
    digest: bytes  # digests.of(the payload)
    size: int  # the payload's bytes
    version: int | None
    reward: float | None
    priority: float
    has_token_rewards: bool
    step: int
    response_length: int
    generated: int  # response tokens under the action mask
    prompt_bytes: int  # the bytes of its prompt tokens: a store keeps only a long one once (shared_prompts.py)
    segments: tuple[int, ...] = ()  # per-token policy versions, flattened (client/trxp/codec/segments.py)
    piece: partial.Mark | None = None  # a piece of a partial rollout: its offset, more to come
    chunks: tuple[bytes, ...] = ()  # with a head for blob: its chunks, compressed off the writer (chunked.compressed)
    together: PutTogether | None = None  # a last piece's rollout put together off the writer (partial_assembly.py)

    @classmethod
    def of(cls, item: RawItem) -> Entry:
        blob = pack_item(item)
        return cls.staged(item, blob, digests.of(blob), len(blob), item.generated_tokens)

    @classmethod
    def staged(cls, item: RawItem, blob: bytes, digest: bytes, size: int, generated: int) -> Entry:
        """An item whose payload is `blob` (a head, for one whose section a push staged: its
        payload's `digest`, `size` and `generated` tokens taken as it was staged); no tensor's
        data is read.

        Its fields are set here on a bare instance, not through the dataclass's __init__ (a call
        through the type, interpreted: 1.5 k instructions of a push's 18 k an experience), and
        its tokens' tensor and the item's attributes are each read once (a compiled class's
        attribute is a look-up by name: RawItem.response_length reads them again)."""
        meta, tensors = item.meta, item.tensors
        tokens = tensors["tokens"]
        eid = meta["eid"]
        info = meta.get("info")  # a checked item's info is a dict where it has one
        prompt_length = meta.get("prompt_length", 1)
        entry = _NEW(cls)
        entry.uid, entry.tid, entry.rid, entry.sid = ids_of(eid, item.checked_uid)  # as the push's check made it
        entry.blob, entry.digest, entry.size = blob, digest, size
        if info:
            entry.version, entry.segments = versions(info)
            entry.piece = partial.marks_in(info)
            priority = info.get("priority", 0.0)
            # + 0.0 makes -0.0 the 0.0 it equals: the priority index orders keys by their bits; a float (the
            # default's among them) is taken as it is, no isinstance of a tuple nor float() called
            if type(priority) is float:
                entry.priority = priority + 0.0
            else:
                entry.priority = float(priority) + 0.0 if isinstance(priority, (int, float)) else 0.0
        else:  # none, or empty (Trinity-RFT's default): what versions and marks_in make of an empty one
            entry.version, entry.segments, entry.piece, entry.priority = None, (), None, 0.0
        entry.reward = meta.get("reward")
        entry.has_token_rewards = "token_level_reward" in tensors
        entry.step = eid.get("step", 0)
        entry.response_length = tokens.numel - prompt_length  # RawItem's
        entry.generated = generated
        entry.prompt_bytes = prompt_length * ITEMSIZE[tokens.dtype]
        entry.chunks, entry.together = (), None
        return entry

    @classmethod
    def placed(cls, row: tuple[Any, ...], blob: bytes) -> Entry:
        """An entry of an ingest process's `row`: its fields in their order here (as
        dataclasses.fields lists them), the payload's length in blob's place, and its payload
        `blob`. Set on a bare instance in one unpacking, as `staged` sets them: through the
        dataclass's __init__ (its arguments starred around the blob) it cost 8.3 k instructions
        an experience, this 4.6 k."""
        entry = _NEW(cls)
        (
            entry.uid, entry.tid, entry.rid, entry.sid, _, entry.digest, entry.size, entry.version, entry.reward,
            entry.priority, entry.has_token_rewards, entry.step, entry.response_length, entry.generated,
            entry.prompt_bytes, entry.segments, entry.piece, entry.chunks, entry.together,
        ) = row  # fmt: skip
        entry.blob = blob
        return entry

    def record(self, gkey: str, *, seq: int, created: float) -> ItemRecord:
        """The record of this experience as a pending member of group `gkey`: what a rows table's
        segment keeps of it (`members`), with its group and ids."""
        return ItemRecord(
            state=PENDING, group=gkey, tid=self.tid, rid=self.rid, digest=self.digest, size=self.size, seq=seq,
            created=created, step=self.step, response_length=self.response_length, generated=self.generated,
            version=self.version, reward=self.reward, priority=self.priority, segments=self.segments,
        )  # fmt: skip

    def group_key(self, group_by: str) -> str:
        key: str = getattr(self, GROUP_KEY_OF[group_by])
        return key


def members(entries: Sequence[Entry], seq: int, created: float) -> list[Member]:
    """The experiences as a rows table's segment keeps them (disk/rows/), the first at `seq` in the
    insertion order, the others after it. Each is made by tuple.__new__ called as it is (Member._make
    less its count of the fields, and less a partial's call around it), as a push makes hundreds."""
    new = tuple.__new__
    return [
        new(Member, (
            e.uid, e.digest, e.size, at, created, e.step, e.response_length, e.generated, e.version, e.reward,
            e.priority, None, None, e.segments,
        ))
        for at, e in enumerate(entries, seq)
    ]  # fmt: skip


def group_keys(entries: Iterable[Entry], group_by: str) -> list[str]:
    """Each entry's group key (`Entry.group_key`), read as one attribute an entry."""
    return list(map(operator.attrgetter(GROUP_KEY_OF[group_by]), entries))


@dataclass(frozen=True, slots=True)
class PutTogether:
    """A large rollout held in pieces, put together off the writer as a staged chunk set by its
    last piece's push (services/assembly.py): the last piece as pushed, and the pieces (offset,
    digest, size) the rollout was put together with, which it must still hold when the writer
    stores it in their place (rules/partial_assembly.py)."""

    piece: Entry
    pieces: tuple[tuple[int, str, int], ...]


@dataclass(slots=True)
class Push:
    """A push as the store takes it: a table, validated entries, and who pushes them (with
    tokens on, a fingerprint of the caller's token; only a claimed prompt's token pushes its
    group). The store reads the entries when the writer stores them and keeps them no longer,
    so whoever made the push lets them go (`entries = []`) as soon as it has the push's result."""

    table: str
    entries: Sequence[Entry]
    holder: str = ""


@dataclass
class FailResult:
    """What a report of failed runs did: the runs recorded (a run reported again is not), the
    groups it completed short, and those it dropped as too short."""

    recorded: list[str] = field(default_factory=list)
    completed_groups: list[str] = field(default_factory=list)
    dropped_groups: list[str] = field(default_factory=list)


@dataclass
class PutResult:
    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    completed_groups: list[str] = field(default_factory=list)
    dropped_groups: list[str] = field(default_factory=list)  # by the zero-variance filter
    stale: list[str] = field(default_factory=list)  # dropped as older than the staleness bound
    partial: list[str] = field(default_factory=list)  # pieces of partial rollouts stored (partials.py)


@dataclass
class Sampled:
    """A selected batch: uids in group order, their group ids and stored payloads.

    The payloads may be views into the store's map, read from `snapshot` (snapshot.py):
    `render` and `payload` read them while they are valid; `release` ends the snapshot
    once the batch's reply is built. `advantages` are the stored values; a table's batch
    stage (`stage`) finishes them once, when the payload is first rendered: where the
    reply is built, outside the store's write transaction."""

    uids: list[str]
    group_ids: list[str]
    blobs: list[Stored | Deferred]  # Deferred: checked where the reply is built (chunk_reads.py)
    advantages: list[Advantage] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # policy version of each experience
    rewards: list[float | None] = field(default_factory=list)  # each experience's, as pushed
    response_lengths: list[int] = field(default_factory=list)  # each experience's generated tokens
    newest_version: int | None = None  # the newest version pushed to the table, for staleness
    trainer_version: int | None = None  # the trainer's version, when set: the reference of staleness
    lease_id: str = ""
    lease_expires: float = 0.0
    partial: bool = False
    times_sampled: list[int] = field(default_factory=list)  # one per uid: its deliveries, this one included
    snapshot: Snapshot | None = field(default=None, repr=False, compare=False)
    stage: Stage | None = field(default=None, repr=False, compare=False)
    shares: Shares | None = None  # a read of some shares of each experience's tokens (ReadFields)
    run_cost: Callable[[int], int] | None = None  # a rank's part: what its split weighed a run of L tokens by
    segments: list[tuple[int, ...]] = field(default_factory=list)  # each one's version segments, as pushed
    # each one's response tokens masked as too stale (a prefix); empty where the table masks none
    masked: list[int] = field(default_factory=list)
    counted: Counted | None = None  # what its take counted as sampled (a held batch's lease keeps it)
    # a rows table's leased batch: its groups as runs (segment, first group, groups), its lease's
    lease_runs: list[tuple[int, int, int]] = field(default_factory=list)
    table_id: int = 0  # the table it was taken from (Sampling.sample): a stream's next takes name it

    @property
    def payload(self) -> bytes:
        return self.render(concatenated)

    def finish(self) -> None:
        """Run the batch stage on the stored advantages, once. A stage that raises raises
        BatchStageFailed naming the groups it raises on alone, or where none does (the batch
        together trips it), every group of the batch: those its caller fails."""
        if self.stage is not None:
            stage, self.stage = self.stage, None
            try:
                self.advantages = stage(self.advantages)
            except Exception as exc:
                raise BatchStageFailed(self._failing(stage, exc), exc) from exc

    def _failing(self, stage: Stage, error: Exception) -> dict[str, str]:
        """The groups `stage` raises on alone, each with what it raised; every group with `error`
        where none does."""
        rows: dict[str, list[int]] = {}
        for at, gkey in enumerate(self.group_ids):
            rows.setdefault(gkey, []).append(at)
        alone = {gkey: stage.raised_over(self.advantages, at) for gkey, at in rows.items()}
        failing = {gkey: stage_error(exc) for gkey, exc in alone.items() if exc is not None}
        return failing or dict.fromkeys(rows, stage_error(error))

    def render(self, build: Callable[[list[Run]], T]) -> T:
        """`build` of the payload as the runs of bytes it is made of (join_parts, client/trxp/stored/splice.py),
        which are valid only during the call: each byte is copied once, by `build`. The
        batch stage runs first, if it has not."""
        self.finish()
        if self.snapshot is None:
            return build(batch_parts(checked(self.blobs), self.advantages, self._masks()))
        with self.snapshot.reading():
            return build(batch_parts(checked(self.blobs), self.advantages, self._masks()))

    def _masks(self) -> Masks | None:
        """The tokens each experience's delivery masks (none where no experience has any)."""
        return Masks(self.masked, self.response_lengths) if any(self.masked) else None

    def columns(self, fields: Sequence[str], build: Callable[[list[ColumnParts]], T]) -> T:
        """`build` of the batch as the columns of `fields` (stored_advantages.batch_columns),
        whose bytes are valid only during the call, as render's are. The batch stage runs first."""
        self.finish()
        tensors = [name for name in fields if name not in SCALARS and name != SEGMENTS]

        def made() -> list[ColumnParts]:
            scalars: dict[str, Sequence[float | int | None]] = {
                "reward": self.rewards,
                "model_version": self.versions,
                "response_length": self.response_lengths,
            }
            if {"length", "prompt_length", "cost"} & set(fields):  # from each stored header, for a trainer's packing
                lengths = [token_length(blob) for blob in self.blobs]
                scalars["length"] = lengths
                scalars["prompt_length"] = [
                    None if length is None else length - response
                    for length, response in zip(lengths, self.response_lengths, strict=True)
                ]
                scalars["cost"] = _costs(lengths, self.run_cost)
            kept = [scalar_column(name, scalars[name]) for name in fields if name in SCALARS]
            if SEGMENTS in fields:
                kept.append(segment_column(self.segments, self.versions))
            ones = [column for column in kept if column is not None]
            if not tensors:
                return ones
            reads = [*tensors, "tokens"] if PREFIX_FIELDS & set(tensors) else tensors  # a tree's are the tokens'
            blobs = checked(self.blobs, reads, self.shares, self.response_lengths)
            columns = batch_columns(blobs, self.advantages, tensors, self.shares, self.response_lengths, self._masks())
            return in_order([*columns, *ones], fields)

        if self.snapshot is None:
            return build(made())
        with self.snapshot.reading():
            return build(made())

    def keep(self, runs: list[Run], charge: Charge | None = None) -> list[Run]:
        """Runs made by `render` or `columns` (views of the snapshot among them), kept readable
        past that call, with `read`: copied in place should the snapshot end before `release`,
        where `charge` has room for them (snapshot.py). Called while `render` or `columns`
        builds them: the stored payloads are read no more (the runs view them), and a detach
        copies them no more (it copied the batch twice)."""
        if self.snapshot is None:
            return runs
        self.snapshot.forget(self.blobs)
        return self.snapshot.hold(runs, charge)

    def read(self, use: Callable[[], T]) -> T:
        """`use()` while the views the batch holds are valid (kept runs among them)."""
        if self.snapshot is None:
            return use()
        with self.snapshot.reading():
            return use()

    def release(self) -> None:
        """End the snapshot the payloads are read from, without copying them: for a batch
        whose reply is built; its payload cannot be read again."""
        if self.snapshot is not None:
            self.snapshot.release()


@dataclass
class ComputeJob:
    """Completed groups of one table whose advantages are to be computed."""

    table: str
    config: TableConfig
    groups: list[str]
    members: list[list[str]]
    records: dict[str, MemberView]  # by uid: reward, ids, step, lengths
    blobs: dict[str, bytes]  # the stored experiences, only for estimators that read tokens
    moments: list[float] | None = None  # the table's running reward moments (counters' reward_moments)
    places: list[int] = field(default_factory=list)  # each group's place in the compute queue, as read
    # The table the worker read the groups from: one made again under its name since is another,
    # which its result and failures must not reach. None for a push's own, computed in its write.
    table_id: int | None = None

    def queued(self) -> dict[str, int]:
        """Each group's place in the compute queue as the job read it (the rseq it took when it
        completed), by key: what finish_compute's `places` checks, so that values computed for a group
        deleted and pushed again meanwhile (which completed again, at another place) stay out."""
        return dict(zip(self.groups, self.places, strict=True))

    def split(self) -> list[ComputeJob]:
        """One job per group, to find which group a failed computation cannot take."""
        return [
            ComputeJob(
                table=self.table,
                config=self.config,
                groups=[gkey],
                members=[members],
                records={uid: self.records[uid] for uid in members},
                blobs={uid: self.blobs[uid] for uid in members if uid in self.blobs},
                moments=self.moments,
                places=[place],
                table_id=self.table_id,
            )
            for gkey, members, place in zip(self.groups, self.members, self.places, strict=True)
        ]


@dataclass
class ShapingUpdate:
    """What reward shaping did in one computation, saved with its advantages."""

    counts: dict[str, int]  # added to the shaping counters (counters.SHAPING_COUNTERS)
    moments: list[float] | None  # the running reward moments after it
    rewards: dict[str, float] = field(default_factory=dict)  # shaped rewards by uid, for the batch stage


# An advantage computation of one job: the values to store by uid, the ready groups, the
# dropped ones, the failed ones with the reason, and what reward shaping did.
Computed = tuple[dict[str, float | bytes], list[str], list[str], dict[str, str], ShapingUpdate]
Compute = Callable[[ComputeJob], Computed]
# A computation done before a push's transaction, for the groups the push is expected to
# complete: the job and its result (pushed_advantages.compute_ahead).
Ahead = tuple[ComputeJob, Computed]


def _costs(lengths: Sequence[int | None], cost: Callable[[int], int] | None) -> list[int | None]:
    """The cost column's values, a run's by `cost` of its tokens: each must be an int64. One past
    it (balance "flops" of a large model over a long run: 12 l h L^2 passes 2^63 for a 405B model at
    700k tokens) or not an integer (a registered cost's) is refused naming the run, where its
    packing failed the read INTERNAL."""
    found: list[int | None] = []
    for length in lengths:
        value = None if length is None or cost is None else cost(length)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not INT64[0] <= value <= INT64[1]
        ):
            raise InvalidRequest(
                f"the cost column: a run of {length} tokens costs {clip(repr(value))} by the read's balance, which "
                "an int64 column does not hold; read the part without the 'cost' field (its split stands), or "
                "balance it by 'tokens'"
            )
        found.append(value)
    return found
