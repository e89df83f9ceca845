"""Rollouts held in pieces (partials.py) as they stand: read for their worker to continue (`held`,
`so_far`), dropped, and handed to a prompt's next attempt.

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

import logging
from collections.abc import Iterable, Sequence

from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.common import RawItem
from expbuf.client.trxp.codec.parse import parse

from ..core.table_state.pending_reads import missing
from ..core.table_state.state import TableState
from ..core.verbs import pieces
from ..disk import piece_rows
from ..disk.piece_rows import PieceHead
from ..schema.errors import DamagedPiece

log = logging.getLogger("expbuf.store")


def items(tt: TableState, uid: str, head: PieceHead) -> list[RawItem]:
    """A rollout's pieces, parsed, each checked against its head first (DamagedPiece)."""
    return [item for raw in pieces.blobs(tt, uid, head) for item in parse(bytes(raw), trusted=True)]


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
    return _so_far(uid, items(tt, uid, head))


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
