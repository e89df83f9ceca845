"""Partial rollouts held in pieces (client/trxp/partial.py says what a piece is): stored as they
are pushed, each durable when its push returns, and put together into one experience when the
last piece comes, stored by that push's transaction; only then does the rollout join its group. A
partial never reaches a sample, a read or an estimator.

A rollout may take at most the bytes of the largest push (the server's max_push_bytes: the
experience it makes is one), and of the table's capacity_bytes where it has one: the piece that
would pass that is refused, TooLarge, and nothing of its push stored. A rollout whose pieces take
more than LARGE is put together off the writer: the writer, its checks passed, asks for it
(`OffWriter`), and the push puts it together from snapshots (partial_assembly.py). A smaller one
is put together in the writer.

Stored per table in the `partials` database (disk/piece_rows.py, kept with the table's counters
by core/verbs/pieces.py): the rollout's head and each piece as the store packs an experience. A piece
meets its group's claim first (the table's extensions: with the prompt ledger only the claimant's
token pushes, or sends again, a prompt's pieces), so no one else hears what the buffer holds of
it; then it is checked against the head alone in the writer (the pieces before it are read only
when the last one comes): it must continue at the tokens held (a
piece sent again, at an offset held with the same bytes, is a duplicate; any other offset is
refused, Conflict), carry what the rollout appends to, and its segments follow. The rollout put
together is checked as a push checks an experience before it is stored.

A rollout's pieces go, are read as they stand, and are handed to a prompt's next attempt as
partial_holds.py says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.build import pack_item
from expbuf.client.trxp.codec.common import RawItem, TrxpError
from expbuf.client.trxp.codec.parse import parse

from ..core.table_state.events import Pushed, Resent
from ..core.table_state.state import TableState
from ..core.verbs import pieces, retire
from ..core.verbs.groups import open_pending
from ..core.verbs.rows import pending as row_pending
from ..disk import digests, piece_rows
from ..disk.chunk_heads import CHUNK_BYTES
from ..disk.kinds import Entry
from ..disk.piece_rows import PieceHead
from ..schema.errors import Conflict, GroupClosed, GroupOverfilled, InvalidPayload, TooLarge, clip
from ..schema.states import PENDING
from . import partial_holds

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


def follows(uid: str, head: PieceHead | None, item: RawItem) -> partial.Versions:
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


def head_grown(head: PieceHead | None, piece: Entry, item: RawItem, versions: partial.Versions) -> PieceHead:
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
    versions = follows(entry.uid, head, item)
    tt.counters.pieces_pushed += 1
    if more:
        grown = head_grown(head, piece, item, versions)
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
    finished = _checked(where, partial.merge([*partial_holds.items(tt, entry.uid, head), item]))
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
