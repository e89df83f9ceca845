"""Partial rollouts held in pieces (client/trxp/partial.py says what a piece is): stored as they
are pushed, each durable when its push returns, and put together into one experience when the
last piece comes, stored by that push's transaction; only then does the rollout join its group. A
partial never reaches a sample, a read or an estimator.

A rollout may take at most the bytes of the largest push (the server's max_push_bytes: the
experience it makes is one), and of the table's capacity_bytes where it has one: the piece that
would pass that is refused, TooLarge, and nothing of its push stored. A rollout whose pieces take
more than LARGE is put together off the writer: the writer, its checks passed, asks for it
(`OffWriter`), the push reads the pieces from snapshots (`plan`, `read_section`) into a staged
chunk set as a push in chunks stages a large experience (services/assembly.py), and the writer
then stores that experience in their place, once it finds the rollout holds the pieces it was put
together from (`PutTogether`): no transaction holds the rollout whole, nor the writer for its
copy. A smaller one is put together in the writer.

Stored per table in the `partials` database (disk/piece_rows.py, kept with the table's counters
by core/verbs/pieces.py): the rollout's head and each piece as the store packs an experience. A piece
meets its group's claim first (the table's extensions: with the prompt ledger only the claimant's
token pushes, or sends again, a prompt's pieces), so no one else hears what the buffer holds of
it; then it is checked against the head alone in the writer (the pieces before it are read only
when the last one comes): it must continue at the tokens held (a
piece sent again, at an offset held with the same bytes, is a duplicate; any other offset is
refused, Conflict), carry what the rollout appends to, and its segments follow. The rollout put
together is checked as a push checks an experience before it is stored.

A rollout's pieces go when it finishes, when its run is reported failed, when its group completes
without it or leaves the table, when a Delete names it or its group, and with the prompt ledger: a
claim that ends before its group is complete hands the rollouts of its attempt to the prompt's
next attempt (`carry`: the pieces move under the next attempt's uids as they are, each rollout
checked first, a damaged one dropped), so whoever claims the prompt next gets them back (`read`)
and continues them; a prompt dropped takes them with it.

Each piece read to put its rollout together (in the writer, or off it: `plan`) or to return it
(`so_far`) is checked against the size and digest its head took at its push (piece_rows.checked):
one lost or damaged raises DamagedPiece, so no experience is stored, and no rollout returned, with
it; so does a head that no longer decodes (piece_rows.decoded). Such a rollout can never be put
together as pushed: its pieces go, in a write of their own after the refusal (`drop_damaged`,
through the store's `quarantine`, as a read's damaged experience is quarantined), so that its
worker pushes it again from its first piece.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import lmdb

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.build import pack_head, pack_item
from expbuf.client.trxp.codec.common import RawItem, RawTensor, TrxpError, count_nonzero
from expbuf.client.trxp.codec.parse import head_length, parse, parse_head
from expbuf.client.trxp.stored.pieces import Bytes

from ..core.table_state.events import Pushed, Resent
from ..core.table_state.pending_reads import missing
from ..core.table_state.state import TableState
from ..core.verbs import pieces, retire
from ..core.verbs.groups import open_pending
from ..core.verbs.rows import pending as row_pending
from ..disk import digests, piece_rows
from ..disk.chunk_heads import CHUNK_BYTES
from ..disk.kinds import Entry
from ..disk.piece_rows import PieceHead
from ..schema.errors import Conflict, DamagedPiece, GroupClosed, GroupOverfilled, InvalidPayload, TooLarge, clip
from ..schema.states import PENDING

log = logging.getLogger("expbuf.store")

# A rollout whose pieces take more is put together off the writer, as a staged chunk set: its
# section is stored in chunks anyway (chunked.py), and a copy of it would hold the writer.
LARGE = CHUNK_BYTES


@dataclass
class PiecesTaken:
    """What the pieces among a push's entries did: the entries left for the group rules (those
    pushed whole, and the rollouts finished now, put together), and the uids of pieces stored
    and of pieces already held (sent again)."""

    entries: list[Entry] = field(default_factory=list)
    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def _items(tt: TableState, uid: str, head: PieceHead) -> list[RawItem]:
    """A rollout's pieces, parsed, each checked against its head first (DamagedPiece)."""
    return [item for raw in pieces.blobs(tt, uid, head) for item in parse(bytes(raw), trusted=True)]


class OffWriter(Exception):
    """Raised in the writer by a last piece whose rollout is LARGE and was not put together off the
    writer from the pieces it holds (or was, from others: they changed since): the push is to put
    it together (services/assembly.py) and come again. Nothing of the push is kept."""

    def __init__(self, uid: str) -> None:
        super().__init__(f"rollout {uid} is put together off the writer")
        self.uid = uid


def take(
    tt: TableState, entries: Sequence[Entry], room: Callable[[int, int], None], most: int, holder: str
) -> PiecesTaken:
    """Store the pieces among a push's entries, in order, and put together the rollouts whose last
    piece came; an entry pushed whole replaces any pieces of its uid. `room(size, opened)` makes room
    in the table for each piece stored and each group a piece opens (capacity.py), as the rollout it
    finishes makes for itself; a
    rollout may take `most` bytes (the largest push), and the table's capacity_bytes (`bounded`).
    `holder` is who pushes (pushes.put)."""
    taken = PiecesTaken()
    finished = _heard(tt, [entry.uid for entry in entries if entry.piece is not None], holder)
    for entry in entries:
        if entry.piece is None:
            if tt.counters.partials:  # a rollout pushed whole replaces its pieces
                pieces.drop(tt, entry.uid)
            taken.entries.append(entry)
            continue
        offset, more = entry.piece
        piece = entry if entry.together is None else entry.together.piece  # the piece as pushed
        gkey = uid_group_key(entry.uid, tt.config.grouping.by) or entry.uid
        if entry.uid in finished:  # a piece of it sent again, by whoever may
            taken.duplicates.append(entry.uid)
            continue
        head = pieces.head(tt, entry.uid)
        held = 0 if head is None else head.tokens
        if head is not None and offset < held and (offset, piece.digest.hex(), piece.size) in head.pieces:
            taken.duplicates.append(entry.uid)
            continue
        if _open_group(tt, gkey):  # a group complete without it says so, not the tokens it does not hold
            room(0, 1)  # its places, as a push that opens it takes
        if offset != held:
            raise Conflict(
                f"a piece of rollout {clip(entry.uid)} continues at token {offset}, but the buffer holds "
                f"{held} of its tokens: each piece continues at the tokens held (get_partials() says how many)"
            )
        bounded(tt, entry.uid, (0 if head is None else piece_rows.size(head)) + piece.size, most)
        (item,) = parse(piece.blob, trusted=True)
        if more:
            room(piece.size, 0)
        whole = _add(tt, entry, item, head, more)
        if whole is None:
            taken.stored.append(entry.uid)
        else:
            taken.entries.append(whole)
    tt.counters.duplicates += len(taken.duplicates)  # as a whole one's are (pushes.put, which saves them)
    return taken


def joinable(tt: TableState, stored: Sequence[str], answered: Collection[str], ended: Collection[str]) -> None:
    """Refuse a push that stores a piece of a run of a group it ends (`ended`: completes or drops),
    which the run could then never join: a group that ends drops its runs held in pieces
    (core/verbs/pieces.drop_group), so the piece would be answered durable and be gone in the same
    commit. GroupOverfilled (the run is one past group_size), GroupClosed with group_size 0
    (the push completes its groups). A piece whose rollout the push also answers otherwise
    (`answered`: stored whole, put together, a duplicate, stale) was replaced, not left out."""
    if not ended:
        return
    size = tt.config.grouping.size
    for uid in stored:
        gkey = uid_group_key(uid, tt.config.grouping.by) or uid
        if gkey in ended and uid not in answered:
            ends = f"its runs complete it, group_size = {size}" if size else "group_size 0: a push completes its groups"
            refusal = GroupOverfilled if size else GroupClosed
            raise refusal(
                f"this push ends group {clip(gkey)} ({ends}) and carries a piece of rollout {clip(uid)}, a run of it "
                "that could then never join it: nothing of this push is stored; push the group's runs without it"
            )


def _heard(tt: TableState, uids: Sequence[str], holder: str) -> set[str]:
    """The extensions hear the pieces' groups before any piece is looked at, once for the
    rollouts already finished (a piece sent again: Resent) and once for the others (Pushed: a
    claim's checks first, so no one else hears what the buffer holds); the finished uids."""
    by = tt.config.grouping.by
    finished = {uid for uid in uids if tt.member(uid) is not None}

    def gkeys(among: Iterable[str]) -> list[str]:
        return list(dict.fromkeys(uid_group_key(uid, by) or uid for uid in among))

    if finished:
        tt.extensions.on_resent(tt, Resent(gkeys(uid for uid in uids if uid in finished), holder))
    if len(finished) < len(set(uids)):
        tt.extensions.on_pushed(tt, Pushed(gkeys(uid for uid in uids if uid not in finished), holder))
    return finished


def bounded(tt: TableState, uid: str, size: int, most: int) -> None:
    """Refuse (TooLarge) a piece with which its rollout would take `size` bytes, more than `most`
    (the largest push: the server's max_push_bytes) or the table's capacity_bytes."""
    capacity = tt.config.capacity.bytes
    if size <= most and not (capacity and size > capacity):
        return
    bound, what = (
        (capacity, f"table '{tt.config.name}''s capacity_bytes")
        if capacity and capacity < most
        else (most, "the server's max_push_bytes, the largest push it takes (EXPBUF_MAX_PUSH_BYTES)")
    )
    raise TooLarge(
        f"rollout {clip(uid)} held in pieces would take {size} bytes with this piece, more than {bound}, {what}: "
        "a rollout in pieces is one experience once put together; nothing of this push is stored"
    )


def dropped_stale(tt: TableState, uids: Sequence[str]) -> None:
    """Rollouts a push dropped as stale, some put together from their pieces: the groups those pieces
    opened (`_open_group`) go where they are left holding nothing (retire.close_bare), as a stale
    run pushed whole opens none."""
    if retire.close_bare(tt, uids):
        tt.save()


def _open_group(tt: TableState, gkey: str) -> bool:
    """The pending group a piece's rollout is to join, opened if none of its runs arrived (as a
    report of a failed run opens it), so that its timeout, a seal and the ledger's end of a claim
    reach the rollouts held in pieces; a complete group takes no more pieces. With group_size 0
    no group waits: none is opened, and one that exists is complete (its rollout's last piece
    would be refused). Whether it opened the group."""
    grp = tt.view(gkey)
    if grp is None and not tt.config.grouping.size:
        return False
    if grp is None and tt.config.storage.layout == "rows":
        row_pending.open_pending(tt, gkey)
        return True
    if grp is None:
        open_pending(tt, gkey)
        return True
    if grp.state != PENDING:
        raise GroupClosed(f"group {clip(gkey)} is already complete ({grp.state}); it takes no more pieces")
    return False


def _follows(uid: str, head: PieceHead | None, item: RawItem) -> partial.Versions:
    """A piece checked against its rollout's head (None: a first piece), InvalidPayload naming
    what does not follow; the rollout's versions once it is added."""
    where = f"rollout {clip(uid)}, piece at token {head.tokens if head else 0}"
    try:
        if head is None and not item.tensors["tokens"].shape[0]:
            raise TrxpError(f"{where}: a first piece has the prompt and the tokens so far; this one has no tokens")
        if head is not None:
            if item.meta.get("prompt_length", 1) != 0:
                raise TrxpError(f"{where}: a piece that continues a rollout has no prompt (prompt_length 0)")
            partial.follows(where, head.layout, item)
        return (head.versions if head else partial.Versions()).after(where, item)
    except TrxpError as exc:
        raise InvalidPayload(str(exc)) from None


def _grown(head: PieceHead | None, piece: Entry, item: RawItem, versions: partial.Versions) -> PieceHead:
    """The head of a rollout once a piece that more follow is added."""
    if head is None:  # a first piece (offset 0), so more follow: one without is pushed whole (partial.mark_of)
        tokens, response = item.tensors["tokens"].shape[0], partial.response_of(item)
        return PieceHead(tokens, response, [(0, piece.digest.hex(), piece.size)], partial.layout(item), versions)
    grown = item.tensors["tokens"].shape[0]
    pieces = [*head.pieces, (head.tokens, piece.digest.hex(), piece.size)]
    return PieceHead(head.tokens + grown, head.response + grown, pieces, head.layout, versions)


def _add(tt: TableState, entry: Entry, item: RawItem, head: PieceHead | None, more: bool) -> Entry | None:
    """One piece into its rollout: stored, or, the last, put together with those before it into the
    entry of the rollout finished (its pieces dropped): here, or for a LARGE rollout off the writer
    (OffWriter; `entry.together` once it was, from the pieces the rollout holds)."""
    piece = entry if entry.together is None else entry.together.piece
    versions = _follows(entry.uid, head, item)
    tt.counters.pieces_pushed += 1
    if more:
        grown = _grown(head, piece, item, versions)
        pieces.write(tt, entry.uid, grown, len(grown.pieces) - 1, piece.blob)
        if head is None:
            tt.counters.partials += 1
        tt.counters.partial_bytes += piece.size
        return None
    assert head is not None, "a last piece continues a rollout held (take checked its offset)"
    if piece_rows.size(head) + piece.size > LARGE:
        if entry.together is None or list(entry.together.pieces) != head.pieces:
            raise OffWriter(entry.uid)
        pieces.drop(tt, entry.uid)
        return dataclasses.replace(entry, piece=None, together=None)
    where = f"rollout {clip(entry.uid)}, piece at token {head.tokens}"
    finished = _checked(where, partial.merge([*_items(tt, entry.uid, head), item]))
    pieces.drop(tt, entry.uid)
    return finished


def _checked(where: str, item: RawItem) -> Entry:
    """A rollout put together, checked as a push checks an experience, as the store keeps it."""
    blob = pack_item(item)
    try:
        (checked,) = parse(blob)
    except TrxpError as exc:
        raise InvalidPayload(f"{where}: the rollout put together is refused: {exc}") from None
    return Entry.staged(checked, blob, digests.of(blob), len(blob), checked.generated_tokens)


# A span of a rollout's section as it is put together: the piece it is read from (a stored piece's
# number, or the payload of one of the push's own), and where in that piece's payload.
Span = tuple[int | Bytes, int, int]


@dataclass(frozen=True)
class Plan:
    """A LARGE rollout to be put together off the writer, as read from a snapshot: the head it was
    read with (which must not change while its section is copied), the pieces it is put together
    from as the head will list them, its payload up to its tensor section (pack_head), that
    section's spans in order (and where each ends in it), the experience it makes (its tensors'
    data left out), checked as a push checks one, and that experience's response tokens under its
    action mask."""

    head: bytes
    pieces: tuple[tuple[int, str, int], ...]
    prefix: list[bytes | memoryview]
    spans: list[Span]
    ends: list[int]
    item: RawItem
    generated: int

    @property
    def section_len(self) -> int:
        return self.ends[-1] if self.ends else 0


def plan(
    txn: lmdb.Transaction[memoryview],
    dbs: Mapping[str, lmdb._Database],
    key: bytes,
    last: Entry,
    earlier: Sequence[Entry],
    read: Callable[[int], None],
) -> Plan | None:
    """How to put together the rollout that the last piece `last` finishes, its head under `key`,
    after this push's `earlier` entries of the same uid (pieces the writer stores before it), from
    a read transaction: pieces' heads parsed, their tensors' data left where it is (`read(size)`
    hears of each stored piece read, for its pages in the map), each stored piece checked against
    its head (DamagedPiece where one is lost or damaged). None where the rollout is not as the
    writer will find it (gone, or not at the last piece's offset: the writer says why);
    InvalidPayload where the rollout put together is refused."""
    raw = piece_rows.head_raw(txn, dbs, key)
    head_raw = b"" if raw is None else bytes(raw)  # none stored: its first piece is the push's
    head = None if raw is None else piece_rows.decoded(head_raw, last.uid)
    sources: list[tuple[int | Bytes, int, dict[str, tuple[int, int]]]] = []  # (piece, data start, spans)
    hollow: list[RawItem] = []
    masked = 0
    if head is not None:
        for number in range(len(head.pieces)):
            blob = piece_rows.checked(txn, dbs, key, last.uid, head, number)
            masked += _hollow(number, blob, sources, hollow)
            read(len(blob))
    for piece in [*earlier, last]:
        if piece.piece is None:  # pushed whole before it: the pieces it replaces are gone
            return None
        offset, tokens = piece.piece[0], 0 if head is None else head.tokens
        if head is not None and offset < tokens and (offset, piece.digest.hex(), piece.size) in head.pieces:
            continue  # sent again: the writer takes it as a duplicate
        if offset != tokens:
            return None
        (item,) = parse(piece.blob, trusted=True)
        versions = _follows(piece.uid, head, item)
        masked += _hollow(piece.blob, piece.blob, sources, hollow)
        if piece is not last:
            head = _grown(head, piece, item, versions)
    if head is None:  # no rollout to finish: the writer says so
        return None
    merged = partial.merge(hollow)
    prefix, order = pack_head(merged)
    section: list[Span] = []
    for name in order:
        for source, start, places in sources if name in head.layout else sources[:1]:
            low, high = places[name]
            section.append((source, start + low, start + high))
    ends = list(itertools.accumulate(end - start for _, start, end in section))
    size = sum(map(len, prefix)) + (ends[-1] if ends else 0)
    try:
        (checked,), _ = parse_head(b"".join(prefix), size, received=size)
    except TrxpError as exc:
        where = f"rollout {clip(last.uid)}, piece at token {head.tokens}"
        raise InvalidPayload(f"{where}: the rollout put together is refused: {exc}") from None
    generated = masked if "action_mask" in merged.tensors else checked.response_length
    pieces = tuple((offset, digest, size) for offset, digest, size in head.pieces)
    return Plan(head_raw, pieces, prefix, section, ends, checked, generated)


def _hollow(
    source: int | Bytes,
    blob: Bytes,
    sources: list[tuple[int | Bytes, int, dict[str, tuple[int, int]]]],
    hollow: list[RawItem],
) -> int:
    """A piece's payload read for a plan: its item with its tensors' data left out (onto `hollow`),
    where each tensor's data lies in it (onto `sources`); returns its action mask's tokens set."""
    view = memoryview(blob)
    start = head_length(view, len(view))
    (item,), places = parse_head(view[:start], len(view), received=len(view))
    spans = {name: (low, high) for low, high, _, name in places}
    sources.append((source, start, spans))
    hollow.append(RawItem(item.meta, {name: RawTensor(t.dtype, t.shape, b"") for name, t in item.tensors.items()}))
    mask = item.tensors.get("action_mask")
    if mask is None:
        return 0
    low, high = spans["action_mask"]
    return count_nonzero(RawTensor(mask.dtype, mask.shape, view[start + low : start + high]))


def read_section(
    txn: lmdb.Transaction[memoryview],
    dbs: Mapping[str, lmdb._Database],
    key: bytes,
    planned: Plan,
    at: int,
    out: bytearray,
    read: Callable[[int], None],
) -> bool:
    """Fill `out` with the planned rollout's section from byte `at`, its stored pieces read in this
    transaction (`read(size)` hears of each); False, `out` unfilled, where the rollout's head is not
    the one planned from (its pieces changed)."""
    raw = piece_rows.head_raw(txn, dbs, key)
    if (b"" if raw is None else bytes(raw)) != planned.head:
        return False
    index = bisect.bisect_right(planned.ends, at)
    filled = 0
    blobs: dict[int, Bytes] = {}
    while filled < len(out) and index < len(planned.spans):
        source, start, end = planned.spans[index]
        begin = planned.ends[index] - (end - start)  # the span's place in the section
        skip = at + filled - begin
        take = min(end - start - skip, len(out) - filled)
        if isinstance(source, int):
            if source not in blobs:
                found = piece_rows.piece(txn, dbs, key, source)
                if found is None:
                    return False
                blobs[source] = found
                read(len(found))
            blob = blobs[source]
        else:
            blob = source
        out[filled : filled + take] = memoryview(blob)[start + skip : start + skip + take]
        filled += take
        index += 1
    return filled == len(out)


def held(tt: TableState, tids: Sequence[str], uids: Sequence[str] = ()) -> list[tuple[str, int]]:
    """The rollouts held in pieces of these tasks (tid: batch/task) and of these uids, each once,
    with the bytes of their pieces (0 for one whose head no longer decodes: `so_far` refuses it)."""
    found: dict[str, int] = {}
    for uid in [*(uid for tid in tids for uid in pieces.of_task(tt, tid)), *uids]:
        try:
            named = pieces.head(tt, uid)
        except DamagedPiece:
            found[uid] = 0
            continue
        if named is not None:
            found[uid] = piece_rows.size(named)
    return list(found.items())


def so_far(tt: TableState, uid: str) -> RawItem:
    """A rollout held in pieces put together as it stands, marked partial: what a worker continues
    from (its next piece continues at its tokens). DamagedPiece where its head or a piece is."""
    head = pieces.head(tt, uid)
    if head is None:
        raise missing("partial rollout", uid)
    return _so_far(uid, _items(tt, uid, head))


def _so_far(uid: str, pieces: Sequence[RawItem]) -> RawItem:
    """A rollout's pieces put together as it stands, marked partial, under its uid (pieces moved
    to a prompt's next attempt keep the eid they were pushed with)."""
    item = partial.merge(pieces)
    item.meta["info"] = {**(item.meta.get("info") or {}), partial.PARTIAL: True}
    if item.uid != uid:
        batch, task, run, step, suffix = uid.rsplit("/", 4)
        item.meta["eid"] = {"batch": batch, "task": task, "run": int(run), "step": int(step), "suffix": suffix}
    return item


def drop_damaged(tt: TableState, uids: Iterable[str]) -> int:
    """Drop the rollouts among `uids` held in pieces one of whose pieces, read again here in the
    writer's transaction, is lost or damaged (a push of its last piece, a read of it or the scrub
    found it): it can never be put together, so its worker pushes it again from its first piece.
    Each is logged, counted in `damaged` and named in `last_failure`, as a quarantined experience
    is; those intact or gone since they were found are left alone. A rollout whose head no longer
    decodes is dropped so too. Returns how many were dropped."""
    if not tt.counters.partials:
        return 0
    return sum(_dropped_if_damaged(tt, uid) for uid in dict.fromkeys(uids))


def _dropped_if_damaged(tt: TableState, uid: str) -> bool:
    """drop_damaged of one rollout: whether it was damaged, and dropped."""
    damage = pieces.damage(tt, uid)
    if damage is None:
        return False
    log.error(
        "table %s: partial rollout %s%s dropped (%s): its worker pushes it again from its first piece",
        tt.config.name, uid, damage.piece, damage.why,
    )  # fmt: skip
    tt.counters.damaged += 1
    tt.counters.last_failure = f"partial rollout {uid}{damage.piece}: {damage.why}: its pieces dropped"
    return pieces.drop(tt, uid)


def drop_task(tt: TableState, tid: str) -> int:
    """Drop the rollouts held in pieces of task `tid`, whatever the table's grouping (a prompt's
    attempt the ledger drops); returns how many."""
    return sum(pieces.drop(tt, uid) for uid in pieces.of_task(tt, tid))


def carry(tt: TableState, old: str, new: tuple[str, str]) -> int:
    """Hand the rollouts held in pieces of task `old` (a prompt's attempt whose claim ended) to the
    task `new` (batch, task: its next attempt), under the same run, step and suffix: the pieces
    move as they are (the last piece, pushed under the new uid, gives the rollout its eid). Each
    rollout is checked first: one with a piece lost or damaged, or a head that no longer decodes,
    is dropped as drop_damaged drops it (logged, counted in `damaged`) rather than handed on, and
    the next claimant starts it over. Returns how many were handed on."""
    moved = 0
    for uid in pieces.of_task(tt, old):
        if _dropped_if_damaged(tt, uid):
            continue
        _, _, run, step, suffix = uid.rsplit("/", 4)
        moved += pieces.carry(tt, uid, f"{new[0]}/{new[1]}/{run}/{step}/{suffix}")
    return moved
