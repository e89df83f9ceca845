"""A table's rollouts held in pieces as the table core keeps them: their rows (disk/piece_rows.py)
with the table's counters of them (partials, partial_bytes) changed beside the rows. What a piece
is, when one is stored and when a rollout is put together is rules/partials.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from expbuf.client.schema.routing import uid_group_key

from ...disk import piece_rows
from ...disk.piece_rows import PieceHead, Value
from ..table_state.state import TableState, missing


def head(tt: TableState, uid: str) -> PieceHead | None:
    """The head of the uid's rollout held in pieces; None: it holds none."""
    return piece_rows.head(tt.txn, tt.db, piece_rows.head_key(tt.prefix, uid))


def blobs(tt: TableState, uid: str, head: PieceHead) -> Iterator[Value]:
    """The pieces of a rollout, in order, each as stored, read one at a time (a rollout's pieces
    may take the largest push); one its head names and not stored is damage."""
    key = piece_rows.head_key(tt.prefix, uid)
    for number in range(len(head.pieces)):
        raw = piece_rows.piece(tt.txn, tt.db, key, number)
        if raw is None:
            raise missing(f"piece {number} of the partial rollout", uid)
        yield raw


def write(tt: TableState, uid: str, head: PieceHead, number: int, blob: bytes) -> None:
    """Piece `number` of a rollout, with its head as it is with it."""
    key = piece_rows.head_key(tt.prefix, uid)
    piece_rows.put_piece(tt.txn, tt.db, key, number, blob)
    piece_rows.put_head(tt.txn, tt.db, key, head)


def drop(tt: TableState, uid: str) -> bool:
    """Drop a rollout's pieces; whether it had any."""
    found = head(tt, uid)
    if found is None:
        return False
    piece_rows.delete(tt.txn, tt.db, piece_rows.head_key(tt.prefix, uid), found)
    tt.counters.partials -= 1
    tt.counters.partial_bytes = max(0, tt.counters.partial_bytes - piece_rows.size(found))
    return True


def of_task(tt: TableState, tid: str) -> list[tuple[str, PieceHead]]:
    """The rollouts held in pieces under task `tid`, with their heads."""
    rows = piece_rows.heads_under(tt.txn, tt.db, tt.key(tid + "/"), tt.prefix)
    return [(uid, PieceHead.decode(raw)) for uid, raw in rows if uid_group_key(uid, "task") == tid]


def drop_group(tt: TableState, gkey: str) -> int:
    """Drop the rollouts held in pieces of a group that completes without them (sealed, timed out)
    or leaves the table; returns how many. A table whose groups complete with each push (group_size
    0) has no runs to wait for: its rollouts in pieces join whichever group their task has then."""
    if not _droppable(tt):
        return 0
    by = tt.config.grouping.by
    if by == "none":
        return int(drop(tt, gkey))
    start = (gkey.rsplit("/", 1)[0] if by == "step" else gkey) + "/"
    rows = piece_rows.heads_under(tt.txn, tt.db, tt.key(start), tt.prefix)
    return sum(drop(tt, uid) for uid, _ in rows if uid_group_key(uid, by) == gkey)


def drop_groups(tt: TableState, gkeys: Callable[[], Iterable[str]]) -> int:
    """`drop_group` of each of the groups `gkeys` names (a batch that leaves the table): their keys
    not even read where nothing can be dropped."""
    return sum(drop_group(tt, gkey) for gkey in gkeys()) if _droppable(tt) else 0


def _droppable(tt: TableState) -> bool:
    """Whether the table may hold rollouts in pieces that a group's end drops."""
    return bool(tt.counters.partials) and bool(tt.config.grouping.size)


def carry(tt: TableState, uid: str, head: PieceHead, target: str) -> None:
    """The pieces of the uid's rollout moved as they are under the uid `target` (which holds none),
    counted there; those under `uid` dropped."""
    drop(tt, target)  # none there, but never two heads counted for one rollout
    to = piece_rows.head_key(tt.prefix, target)
    for number, raw in enumerate(blobs(tt, uid, head)):
        piece_rows.put_piece(tt.txn, tt.db, to, number, bytes(raw))
    piece_rows.put_head(tt.txn, tt.db, to, head)
    tt.counters.partials += 1
    tt.counters.partial_bytes += piece_rows.size(head)
    drop(tt, uid)
