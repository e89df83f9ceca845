"""Partial rollouts held in pieces (client/trxp/partial.py says what a piece is): stored as they
are pushed, each durable when its push returns, and put together into one experience when the
last piece comes, in that push's transaction; only then does the rollout join its group. A
partial never reaches a sample, a read or an estimator.

Stored per table in the `partials` database: T + uid + NUL -> the rollout's head (JSON: the
tokens and response tokens held, each piece's offset and digest, the tensors later pieces append
to, what its version segments say so far), and T + uid + NUL + piece number (u32) -> the piece as
the store packs an experience. A piece meets its group's claim first (the table's extensions: with
the prompt ledger only the claimant's token pushes, or sends again, a prompt's pieces), so no one
else hears what the buffer holds of it; then it is checked against the head alone in the writer (the
pieces before it are read only when the last one comes): it must continue at the tokens held (a
piece sent again, at an offset held with the same bytes, is a duplicate; any other offset is
refused, Conflict), carry what the rollout appends to, and its segments follow. The rollout put
together is checked as a push checks an experience before it is stored.

A rollout's pieces go when it finishes, when its run is reported failed, when its group completes
without it or leaves the table, and with the prompt ledger: a claim that ends before its group is
complete hands the rollouts of its attempt to the prompt's next attempt (`carry`: the pieces move
under the next attempt's uids as they are), so whoever claims the prompt next gets them back
(`read`) and continues them; a prompt dropped takes them with it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp import partial
from expbuf.client.trxp.build import pack_item
from expbuf.client.trxp.common import RawItem, TrxpError
from expbuf.client.trxp.parse import parse

from ..disk import digests
from ..disk.kinds import Entry
from ..disk.records import GroupRecord
from ..schema.errors import Conflict, GroupClosed, InvalidPayload, clip
from ..schema.states import PENDING
from .table_state import TableState, missing

_PIECE = struct.Struct(">I")


@dataclass
class Head:
    """What the store keeps of a rollout held in pieces, beside them."""

    tokens: int  # the rollout's tokens held (the prompt's among them)
    response: int  # ... of them after the prompt
    pieces: list[tuple[int, str, int]]  # each piece's offset, digest (hex) and size, in order
    layout: partial.Layout
    versions: partial.Versions

    def encode(self) -> bytes:
        versions = [self.versions.carried, self.versions.last]
        return json.dumps(
            {"t": self.tokens, "r": self.response, "p": self.pieces, "l": self.layout, "v": versions},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Head:
        data = json.loads(bytes(raw))
        layout = {name: (dtype, tuple(inner)) for name, (dtype, inner) in data["l"].items()}
        pieces = [(offset, digest, size) for offset, digest, size in data["p"]]
        return cls(data["t"], data["r"], pieces, layout, partial.Versions(*data["v"]))


@dataclass
class Taken:
    """What the pieces among a push's entries did: the entries left for the group rules (those
    pushed whole, and the rollouts finished now, put together), and the uids of pieces stored
    and of pieces already held (sent again)."""

    entries: list[Entry] = field(default_factory=list)
    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


def _head_key(tt: TableState, uid: str) -> bytes:
    return tt.key(uid) + b"\0"


def _head(tt: TableState, uid: str) -> Head | None:
    raw = tt.txn.get(_head_key(tt, uid), db=tt.db["partials"])
    return None if raw is None else Head.decode(raw)


def _pieces(tt: TableState, uid: str, head: Head) -> list[RawItem]:
    base = _head_key(tt, uid)
    items = []
    for number in range(len(head.pieces)):
        raw = tt.txn.get(base + _PIECE.pack(number), db=tt.db["partials"])
        if raw is None:
            raise missing(f"piece {number} of the partial rollout", uid)
        items.extend(parse(bytes(raw), trusted=True))
    return items


def _write(tt: TableState, uid: str, head: Head, number: int, blob: bytes) -> None:
    base = _head_key(tt, uid)
    tt.txn.put(base + _PIECE.pack(number), blob, db=tt.db["partials"])
    tt.txn.put(base, head.encode(), db=tt.db["partials"])


def drop(tt: TableState, uid: str) -> bool:
    """Drop a rollout's pieces; whether it had any."""
    head = _head(tt, uid)
    if head is None:
        return False
    base = _head_key(tt, uid)
    for number in range(len(head.pieces)):
        tt.txn.delete(base + _PIECE.pack(number), db=tt.db["partials"])
    tt.txn.delete(base, db=tt.db["partials"])
    tt.counters.partials -= 1
    tt.counters.partial_bytes = max(0, tt.counters.partial_bytes - _size(head))
    return True


def _size(head: Head) -> int:
    return sum(size for _, _, size in head.pieces)


def take(tt: TableState, entries: Sequence[Entry], room: Callable[[int], None]) -> Taken:
    """Store the pieces among a push's entries, in order, and put together the rollouts whose last
    piece came; an entry pushed whole replaces any pieces of its uid. `room(size)` makes room in
    the table for each piece stored (capacity.py), as the rollout it finishes makes for itself."""
    taken = Taken()
    for entry in entries:
        if entry.piece is None:
            if tt.counters.partials:  # a rollout pushed whole replaces its pieces
                drop(tt, entry.uid)
            taken.entries.append(entry)
            continue
        offset, more = entry.piece
        gkey = uid_group_key(entry.uid, tt.config.grouping.by) or entry.uid
        if tt.item(entry.uid) is not None:  # finished already: a piece of it sent again, by whoever may
            tt.extensions.on_resend(tt, [gkey])
            taken.duplicates.append(entry.uid)
            continue
        tt.extensions.on_push(tt, [gkey])  # a claim's checks first: no one else hears what the buffer holds
        head = _head(tt, entry.uid)
        held = 0 if head is None else head.tokens
        if head is not None and offset < held and (offset, entry.digest.hex(), entry.size) in head.pieces:
            taken.duplicates.append(entry.uid)
            continue
        if offset != held:
            raise Conflict(
                f"a piece of rollout {clip(entry.uid)} continues at token {offset}, but the buffer holds "
                f"{held} of its tokens: each piece continues at the tokens held (get_partials() says how many)"
            )
        if tt.config.grouping.size:
            _open_group(tt, gkey)
        (item,) = parse(entry.blob, trusted=True)
        if more:
            room(entry.size)
        finished = _add(tt, entry, item, head, more)
        if finished is None:
            taken.stored.append(entry.uid)
        else:
            taken.entries.append(finished)
    return taken


def _open_group(tt: TableState, gkey: str) -> None:
    """The pending group a piece's rollout is to join, opened if none of its runs arrived (as a
    report of a failed run opens it), so that its timeout, a seal and the ledger's end of a claim
    reach the rollouts held in pieces; a complete group takes no more pieces."""
    grp = tt.group(gkey)
    if grp is None:
        grp = GroupRecord(state=PENDING, created=tt.now)
        tt.counters.groups_pending += 1
        tt.txn.put(tt.pending_key(gkey, grp), b"", db=tt.db["pending"])
        tt.put_group(gkey, grp)
    elif grp.state != PENDING:
        raise GroupClosed(f"group {clip(gkey)} is already complete ({grp.state}); it takes no more pieces")


def _add(tt: TableState, entry: Entry, item: RawItem, head: Head | None, more: bool) -> Entry | None:
    """One piece into its rollout: stored, or, the last, put together with those before it into the
    entry of the rollout finished (its pieces dropped)."""
    where = f"rollout {clip(entry.uid)}, piece at token {head.tokens if head else 0}"
    try:
        if head is None and not item.tensors["tokens"].shape[0]:
            raise TrxpError(f"{where}: a first piece has the prompt and the tokens so far; this one has no tokens")
        if head is not None:
            if item.meta.get("prompt_length", 1) != 0:
                raise TrxpError(f"{where}: a piece that continues a rollout has no prompt (prompt_length 0)")
            partial.follows(where, head.layout, item)
        versions = (head.versions if head else partial.Versions()).after(where, item)
    except TrxpError as exc:
        raise InvalidPayload(str(exc)) from None
    tt.counters.pieces_pushed += 1
    if head is None:  # a first piece (offset 0), so more follow: one without is pushed whole (partial.mark_of)
        tokens, response = item.tensors["tokens"].shape[0], partial.response_of(item)
        first = Head(tokens, response, [(0, entry.digest.hex(), entry.size)], partial.layout(item), versions)
        _write(tt, entry.uid, first, 0, entry.blob)
        tt.counters.partials += 1
        tt.counters.partial_bytes += entry.size
        return None
    if more:
        grown = item.tensors["tokens"].shape[0]
        head.pieces.append((head.tokens, entry.digest.hex(), entry.size))
        head.tokens += grown
        head.response += grown
        head.versions = versions
        _write(tt, entry.uid, head, len(head.pieces) - 1, entry.blob)
        tt.counters.partial_bytes += entry.size
        return None
    finished = _checked(where, partial.merge([*_pieces(tt, entry.uid, head), item]))
    drop(tt, entry.uid)
    return finished


def _checked(where: str, item: RawItem) -> Entry:
    """A rollout put together, checked as a push checks an experience, as the store keeps it."""
    blob = pack_item(item)
    try:
        (checked,) = parse(blob)
    except TrxpError as exc:
        raise InvalidPayload(f"{where}: the rollout put together is refused: {exc}") from None
    return Entry.staged(checked, blob, digests.of(blob), len(blob), checked.generated_tokens)


def held(tt: TableState, tids: Sequence[str], uids: Sequence[str] = ()) -> list[tuple[str, int]]:
    """The rollouts held in pieces of these tasks (tid: batch/task) and of these uids, each once,
    with the bytes of their pieces."""
    found: dict[str, int] = {}
    for tid in tids:
        for uid, head in _of_task(tt, tid):
            found[uid] = _size(head)
    for uid in uids:
        named = _head(tt, uid)
        if named is not None:
            found[uid] = _size(named)
    return list(found.items())


def so_far(tt: TableState, uid: str) -> RawItem:
    """A rollout held in pieces put together as it stands, marked partial: what a worker continues
    from (its next piece continues at its tokens)."""
    head = _head(tt, uid)
    if head is None:
        raise missing("partial rollout", uid)
    return _so_far(uid, _pieces(tt, uid, head))


def _so_far(uid: str, pieces: Sequence[RawItem]) -> RawItem:
    """A rollout's pieces put together as it stands, marked partial, under its uid (pieces moved
    to a prompt's next attempt keep the eid they were pushed with)."""
    item = partial.merge(pieces)
    item.meta["info"] = {**(item.meta.get("info") or {}), partial.PARTIAL: True}
    if item.uid != uid:
        batch, task, run, step, suffix = uid.rsplit("/", 4)
        item.meta["eid"] = {"batch": batch, "task": task, "run": int(run), "step": int(step), "suffix": suffix}
    return item


def _of_task(tt: TableState, tid: str) -> Iterator[tuple[str, Head]]:
    """The rollouts held in pieces under task `tid`, with their heads."""
    start = tt.key(tid + "/")
    with tt.txn.cursor(db=tt.db["partials"]) as cur:
        found = cur.set_range(start)
        rows = []
        while found and bytes(cur.key()).startswith(start):
            uid = _head_of(bytes(cur.key()), tt.prefix)
            if uid is not None and uid_group_key(uid, "task") == tid:
                rows.append((uid, Head.decode(cur.value())))
            found = cur.next()
    yield from rows


def _head_of(key: bytes, prefix: bytes) -> str | None:
    """The uid of a rollout's head key (T + uid + NUL); None for a piece's (a uid holds no NUL)."""
    end = key.index(b"\0", len(prefix))
    return key[len(prefix) : end].decode() if end == len(key) - 1 else None


def drop_group(tt: TableState, gkey: str) -> int:
    """Drop the rollouts held in pieces of a group that completes without them (sealed, timed out)
    or leaves the table; returns how many. A table whose groups complete with each push (group_size
    0) has no runs to wait for: its rollouts in pieces join whichever group their task has then."""
    if not tt.counters.partials or not tt.config.grouping.size:
        return 0
    by = tt.config.grouping.by
    if by == "none":
        return int(drop(tt, gkey))
    start = (gkey.rsplit("/", 1)[0] if by == "step" else gkey) + "/"
    key = tt.key(start)
    uids = []
    with tt.txn.cursor(db=tt.db["partials"]) as cur:
        found = cur.set_range(key)
        while found and bytes(cur.key()).startswith(key):
            uid = _head_of(bytes(cur.key()), tt.prefix)
            if uid is not None and uid_group_key(uid, by) == gkey:
                uids.append(uid)
            found = cur.next()
    return sum(drop(tt, uid) for uid in uids)


def drop_task(tt: TableState, tid: str) -> int:
    """Drop the rollouts held in pieces of task `tid`, whatever the table's grouping (a prompt's
    attempt the ledger drops); returns how many."""
    return sum(drop(tt, uid) for uid, _ in list(_of_task(tt, tid)))


def carry(tt: TableState, old: str, new: tuple[str, str]) -> int:
    """Hand the rollouts held in pieces of task `old` (a prompt's attempt whose claim ended) to the
    task `new` (batch, task: its next attempt), under the same run, step and suffix: the pieces
    move as they are (the last piece, pushed under the new uid, gives the rollout its eid);
    returns how many."""
    moved = 0
    db = tt.db["partials"]
    for uid, head in list(_of_task(tt, old)):
        _, _, run, step, suffix = uid.rsplit("/", 4)
        target = f"{new[0]}/{new[1]}/{run}/{step}/{suffix}"
        drop(tt, target)  # none there, but never two heads counted for one rollout
        base, to = _head_key(tt, uid), _head_key(tt, target)
        for number in range(len(head.pieces)):
            raw = tt.txn.get(base + _PIECE.pack(number), db=db)
            if raw is None:
                raise missing(f"piece {number} of the partial rollout", uid)
            tt.txn.put(to + _PIECE.pack(number), bytes(raw), db=db)
        tt.txn.put(to, head.encode(), db=db)
        tt.counters.partials += 1
        tt.counters.partial_bytes += _size(head)
        drop(tt, uid)
        moved += 1
    return moved
