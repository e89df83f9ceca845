"""A table's rollouts held in pieces as the table core keeps them: their rows (disk/piece_rows.py)
with the table's counters of them (partials, partial_bytes) changed beside the rows, and the check
of the two (`verify`). A rollout's pieces read to be put together or returned are each checked
against the size and digest its head took at its push (`blobs`). What a piece is, when one is
stored and when a rollout is put together is rules/partials.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from expbuf.client.schema.routing import uid_group_key

from ...disk import piece_rows
from ...disk.piece_rows import PieceHead, Value
from ...schema.errors import DamagedPiece
from ...schema.states import PENDING, State
from ..table_state.state import TableState


def head(tt: TableState, uid: str) -> PieceHead | None:
    """The head of the uid's rollout held in pieces; None: it holds none. DamagedPiece where it no
    longer decodes."""
    return piece_rows.head(tt.txn, tt.db, piece_rows.head_key(tt.prefix, uid), uid)


def blobs(tt: TableState, uid: str, head: PieceHead) -> Iterator[Value]:
    """The pieces of a rollout, in order, each as stored, read one at a time (a rollout's pieces
    may take the largest push) and checked against the size and digest its head took at its push:
    one lost or damaged raises DamagedPiece, so that no rollout is put together, or read, with it."""
    key = piece_rows.head_key(tt.prefix, uid)
    for number in range(len(head.pieces)):
        yield piece_rows.checked(tt.txn, tt.db, key, uid, head, number)


def damage(tt: TableState, uid: str) -> DamagedPiece | None:
    """The damage of the uid's rollout held in pieces, as the refusal that names it: its head that
    no longer decodes, or the first of its pieces lost or damaged; None where it holds none, or
    every piece is the one pushed."""
    try:
        found = head(tt, uid)
        for _ in () if found is None else blobs(tt, uid, found):
            pass
    except DamagedPiece as exc:
        return exc
    return None


def write(tt: TableState, uid: str, head: PieceHead, number: int, blob: bytes) -> None:
    """Piece `number` of a rollout, with its head as it is with it."""
    key = piece_rows.head_key(tt.prefix, uid)
    piece_rows.put_piece(tt.txn, tt.db, key, number, blob)
    piece_rows.put_head(tt.txn, tt.db, key, head)


def drop(tt: TableState, uid: str) -> bool:
    """Drop a rollout's pieces; whether it had any. One whose head no longer decodes goes too, the
    bytes of the pieces stored under it uncounted."""
    key = piece_rows.head_key(tt.prefix, uid)
    raw = piece_rows.head_raw(tt.txn, tt.db, key)
    if raw is None:
        return False
    try:
        found = piece_rows.decoded(raw, uid)
    except DamagedPiece:
        freed = piece_rows.delete_under(tt.txn, tt.db, key)
    else:
        piece_rows.delete(tt.txn, tt.db, key, found)
        freed = piece_rows.size(found)
    tt.counters.partials -= 1
    tt.counters.partial_bytes = max(0, tt.counters.partial_bytes - freed)
    return True


def of_task(tt: TableState, tid: str) -> list[str]:
    """The uids of the rollouts held in pieces under task `tid`."""
    rows = piece_rows.heads_under(tt.txn, tt.db, tt.key(tid + "/"), tt.prefix)
    return [uid for uid, _ in rows if uid_group_key(uid, "task") == tid]


def drop_group(tt: TableState, gkey: str) -> int:
    """Drop the rollouts held in pieces of a group that completes without them (with all its runs,
    sealed, timed out; with group_size 0, by the push that carries it, which they held pieces before)
    or leaves the table; returns how many. A complete group takes no more pieces, nor a run's last:
    kept, they could never finish, and would stay counted against the capacity."""
    return _drop_of(tt, gkey) if _droppable(tt) else 0


def drop_named(tt: TableState, gkeys: Iterable[str]) -> int:
    """Drop the rollouts held in pieces of the groups a Delete names, whatever the table's
    group_size: in a table whose groups complete with each push (group_size 0) no timeout, seal or
    report of a failed run reaches them, and a Delete of their group is how they go. Returns how many."""
    return sum(_drop_of(tt, gkey) for gkey in dict.fromkeys(gkeys)) if tt.counters.partials else 0


def drop_deleted(tt: TableState, uids: Iterable[str]) -> list[str]:
    """Drop the rollouts held in pieces under the uids a Delete names, as their group's Delete drops
    them: a user deleting a uid means it gone, whole or in pieces. Returns the keys of the pending
    groups they leave holding nothing (no member, no run in pieces or reported failed), to go as
    groups a Delete names bare do."""
    if not tt.counters.partials:
        return []
    by = tt.config.grouping.by
    gkeys = dict.fromkeys(uid_group_key(uid, by) or uid for uid in dict.fromkeys(uids) if drop(tt, uid))
    return [gkey for gkey in gkeys if tt.config.grouping.size and bare(tt, gkey)]


def bare(tt: TableState, gkey: str) -> bool:
    """Whether group `gkey` is pending and holds nothing: no member, no run in pieces or reported failed."""
    grp = tt.view(gkey)
    return grp is not None and grp.state == PENDING and not grp.members and not grp.failed and not _held_in(tt, gkey)


def _drop_of(tt: TableState, gkey: str) -> int:
    """Drop the rollouts held in pieces whose uids fall in group `gkey`; returns how many."""
    return sum(drop(tt, uid) for uid in _held_in(tt, gkey))


def _held_in(tt: TableState, gkey: str) -> list[str]:
    """The uids of the rollouts held in pieces whose uids fall in group `gkey`."""
    by = tt.config.grouping.by
    if by == "none":
        return [gkey] if piece_rows.head_raw(tt.txn, tt.db, piece_rows.head_key(tt.prefix, gkey)) is not None else []
    start = (gkey.rsplit("/", 1)[0] if by == "step" else gkey) + "/"
    rows = piece_rows.heads_under(tt.txn, tt.db, tt.key(start), tt.prefix)
    return [uid for uid, _ in rows if uid_group_key(uid, by) == gkey]


def drop_groups(tt: TableState, gkeys: Callable[[], Iterable[str]]) -> int:
    """`drop_group` of each of the groups `gkeys` names (a batch that leaves the table): their keys
    not even read where nothing can be dropped."""
    return sum(drop_group(tt, gkey) for gkey in gkeys()) if _droppable(tt) else 0


def _droppable(tt: TableState) -> bool:
    """Whether the table may hold rollouts in pieces that a group's end drops."""
    return bool(tt.counters.partials)


def carry(tt: TableState, uid: str, target: str) -> bool:
    """The pieces of the uid's rollout moved as they are under the uid `target` (which holds none),
    counted there, each read checked (`blobs`: the caller dropped a damaged rollout first); those
    under `uid` dropped. Whether it held any."""
    found = head(tt, uid)
    if found is None:
        return False
    drop(tt, target)  # none there, but never two heads counted for one rollout
    to = piece_rows.head_key(tt.prefix, target)
    for number, raw in enumerate(blobs(tt, uid, found)):
        piece_rows.put_piece(tt.txn, tt.db, to, number, bytes(raw))
    piece_rows.put_head(tt.txn, tt.db, to, found)
    tt.counters.partials += 1
    tt.counters.partial_bytes += piece_rows.size(found)
    return drop(tt, uid)


def verify(tt: TableState) -> list[str]:
    """The problems of a table's rollouts held in pieces, as verify() and `expbuf check` read a
    pending group's head and fragments: each head decodes, each piece it names is stored and the one
    pushed (its size and digest), no piece is stored that no head names, and the counters count the
    heads and their pieces' bytes. A head that does not decode is one problem, its pieces none."""
    problems: list[str] = []
    heads, total, undecoded = 0, 0, False
    uid: str | None = None  # the rollout whose rows are being read
    head: PieceHead | None = None
    seen: set[int] = set()
    headless: dict[str, int] = {}  # the pieces stored of each rollout whose head is not

    def ended() -> None:
        if uid is not None and head is not None:
            problems.extend(
                f"partial rollout {uid}: its piece {number} is not stored"
                for number in range(len(head.pieces))
                if number not in seen
            )

    for row_uid, number, value in piece_rows.rows(tt.txn, tt.db, tt.prefix):
        if row_uid is None:
            problems.append("a row of the partials database is neither a rollout's head nor a piece")
        elif number is None:
            ended()
            uid, head, seen, heads = row_uid, None, set(), heads + 1
            try:
                head = PieceHead.decode(value)
            except Exception as exc:  # a damaged page can make the decoder raise almost anything
                problems.append(f"the head of partial rollout {uid} does not decode ({type(exc).__name__}: {exc})")
                undecoded = True
                continue
            total += piece_rows.size(head)
        elif row_uid != uid:
            headless[row_uid] = headless.get(row_uid, 0) + 1
        elif head is not None and number >= len(head.pieces):
            names = len(head.pieces)
            problems.append(f"partial rollout {uid}: its piece {number} is stored, but its head names {names}")
        elif head is not None:
            seen.add(number)
            problem = piece_rows.problem(head, number, value)
            if problem is not None:
                problems.append(f"partial rollout {uid}, piece {number}: {problem}")
    ended()
    problems.extend(f"partial rollout {key}: {n} piece(s) are stored but not its head" for key, n in headless.items())
    counted = (tt.counters.partials, tt.counters.partial_bytes)
    if undecoded and counted[0] != heads:
        problems.append(f"counter partials is {counted[0]} but {heads} rollout(s) held in pieces were found")
    elif not undecoded and counted != (heads, total):
        problems.append(
            f"counters partials and partial_bytes are {counted[0]} and {counted[1]} but {heads} rollout(s) of "
            f"{total} bytes were found"
        )
    return problems


def stranded(tt: TableState) -> list[str]:
    """The rollouts held in pieces whose group is complete, as problems: it takes no more pieces,
    so nothing reads them, and they stay counted against the capacity until it leaves the table
    (a group's completion drops them; an earlier release left them, in a table of group_size 0 for
    good). A group not stored is none (a prompt's next attempt holds the pieces handed it before it
    is claimed)."""
    problems: list[str] = []
    states: dict[str, State | None] = {}
    for uid, _ in piece_rows.heads_under(tt.txn, tt.db, tt.prefix, tt.prefix):
        gkey = uid_group_key(uid, tt.config.grouping.by) or uid
        if gkey not in states:
            try:
                grp = tt.view(gkey)
            except Exception:  # a group record a damaged page left undecodable: the group's check names it
                grp = None
            states[gkey] = None if grp is None else grp.state
        state = states[gkey]
        if state is not None and state != PENDING:
            problems.append(
                f"partial rollout {uid}: its group {gkey} is complete ({state}), so its pieces never join it; "
                "they go when the group leaves the table, or with a Delete of it"
            )
    return problems
