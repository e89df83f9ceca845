"""Small pushes of several callers, side by side in the writer's queue, stored as one push (issue 64).

Rollout workers that push each run as it ends (an asynchronous agent's; GRPO's workers, each pushing
its own runs of a task) send pushes of one experience or a few, and each such push cost the writer
some 100 µs of its own beside its experiences' (its table's state and counters read and written, its
groups looked up, its heads and rows written, a nested transaction), where a push of hundreds shares
that among them. The writer runs the requests waiting side by side in one transaction
(disk/environment/writer.py); those of them that are one small push each (fewer than JOIN_BELOW
experiences, no piece of a partial rollout, no advantages computed ahead, not held by a rate limit
before), into one table by one holder, with no uid twice among them, are stored as one push of all
their experiences (`in_turn`), and each caller hears its own part of its result (`split`): the
experiences it stored and the groups whose last runs it brought.
Where that push is refused (a conflict, an overfilled or closed group, a full table, a rate limit
that holds it, a table dropped meanwhile), or finds a retry's copy of a stored experience or a stale
one among them (which may sit in a push after the one that completes its group), nothing of it is
kept and each push is stored alone, in a transaction nested of its own, as every push was before: a
refusal answers only the push it is for, and each caller's answer, and the order in which the groups
they complete are served, are what they would be had each push been sent after the reply of the one
before. So are pushes whose outcome depends on what those before them did (`alike`; a rate limit's
count and the advantages computed in the push, Pushing.put_joined): those into a table that must
make room, a group one completes that a later one brings runs to, a records table's interleaved
groups, a rate limit that would hold one once the groups the others complete count, groups left to
the advantage worker that each push alone would compute.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

from ..core.table_state.state import TableState
from ..disk.environment import Outcome, runs
from ..disk.kinds import Entry, PutResult, group_keys
from ..rules import capacity

if TYPE_CHECKING:
    from .pushing import Pushing, Ready

JOIN_BELOW = 64  # a push of more experiences shares its own cost among them: stored alone


@dataclass(frozen=True, slots=True)
class PushRequest:
    """A caller's pushes as the writer stores them (`Pushing.in_order`), in order; with a `key` (its
    table's id and its holder: `joins`), a small push that `together` may store with others."""

    pushing: Pushing
    pushes: list[Ready]
    final: bool
    blocked: float
    key: tuple[int, str] | None

    def __call__(self, txn: lmdb.Transaction[bytes]) -> tuple[list[PutResult], Exception | None]:
        return self.pushing.in_order(txn, self.pushes, self.final, self.blocked)


def joins(pushes: Sequence[Ready], blocked: float, pieces: bool) -> tuple[int, str] | None:
    """What a request's pushes share with those they may be stored with (their table's id and their
    holder), for a request of one small push (`pieces`: whether any of its entries is a piece of a
    partial rollout) that no rate limit held; None for any other."""
    if len(pushes) != 1 or blocked or pieces:
        return None
    ready = pushes[0]
    if ready.ahead is not None or len(ready.push.entries) >= JOIN_BELOW:
        return None
    return ready.table_id, ready.push.holder


def together(txn: lmdb.Transaction[bytes], requests: list[PushRequest]) -> list[Outcome]:
    """The outcomes of push requests side by side in the writer's queue (environment.Together): each
    run of them of one key stored as one push where it stores so, and every other request alone."""
    environment = requests[0].pushing.environment
    outcomes: list[Outcome] = []
    for run in runs(requests, _key):
        joined = _as_one(txn, run) if len(run) > 1 else None
        outcomes.extend(joined if joined is not None else [environment.run_nested(r, txn) for r in run])
    return outcomes


def _key(request: PushRequest) -> tuple[int, str] | None:
    return request.key


def _as_one(txn: lmdb.Transaction[bytes], run: list[PushRequest]) -> list[Outcome] | None:
    """A run's pushes stored as one push, in a transaction nested in `txn`, each request's outcome its
    own part of the result; None (nothing kept) where they are not stored so."""
    readies = [request.pushes[0] for request in run]
    pushes = [ready.push.entries for ready in readies]
    by = readies[0].config.grouping.by
    entries, last, spread = in_turn(pushes, by)
    if len({entry.uid for entry in entries}) != len(entries):  # a uid twice: each push's answer its own
        return None
    pushing = run[0].pushing
    child = pushing.environment.nested(txn)
    try:
        largest = max(map(len, pushes))
        result = pushing.put_joined(child, readies[0], entries, lambda tt: alike(tt, pushes, entries, spread), largest)
        # a retry's copy, or a stale run, may sit in a push after the one that completes its group
        parts = None if result is None or result.duplicates or result.stale else split(result, pushes, last)
    except lmdb.MapFullError:
        child.abort()
        raise
    except Exception:  # a refusal: each push is stored alone, and refused alone
        parts = None
    if parts is None:
        child.abort()
        return None
    child.commit()
    return [(True, ([part], None)) for part in parts]


def in_turn(pushes: Sequence[Sequence[Entry]], by: str) -> tuple[list[Entry], dict[str, int], dict[str, list[Entry]]]:
    """The entries of pushes in the order in which one push stores them as the pushes one after the
    other would: by group, each group's runs in push order, the groups in the order of the pushes that
    last bring them runs (and in its order there), so that those they complete take the places in the
    ready order (and the compute queue) they would; each group's last push; and the groups whose runs
    come in more than one push, with their runs."""
    groups: dict[str, list[Entry]] = {}
    turn: dict[str, tuple[int, int]] = {}  # a group's last push, and its first place in that push
    spread: dict[str, list[Entry]] = {}
    for at, entries in enumerate(pushes):
        for place, (gkey, entry) in enumerate(zip(group_keys(entries, by), entries, strict=True)):
            runs_of = groups.setdefault(gkey, [])
            runs_of.append(entry)
            if turn.get(gkey, (at, 0))[0] != at:
                spread[gkey] = runs_of
            if turn.get(gkey, (-1, 0))[0] != at:
                turn[gkey] = (at, place)
    order = sorted(groups, key=turn.__getitem__)
    last = {gkey: at for gkey, (at, _) in turn.items()}
    return [entry for gkey in order for entry in groups[gkey]], last, spread


def alike(
    tt: TableState, pushes: Sequence[Sequence[Entry]], entries: Sequence[Entry], spread: Mapping[str, Sequence[Entry]]
) -> bool:
    """Whether `pushes` stored as one push (`entries`, `in_turn`) leave `tt`'s table as they would one
    after the other, where what each does depends on what those before it did: not where a push
    completes a group (a table of group_size 0 completes each with its push; a group's runs reported
    failed count as runs, pushed they add none) that a later one brings runs to, which that one alone
    is refused for; nor where they need room (a push alone may evict a group one before it completed,
    or need none where one before it dropped a group); nor in a records table where runs of groups
    are interleaved (its insertion order, the order in which it evicts, is the order its runs came)."""
    cfg = tt.config
    if spread and not cfg.grouping.size:
        return False
    if cfg.storage.layout == "records" and not all(
        a is b for a, b in zip(entries, itertools.chain.from_iterable(pushes), strict=True)
    ):
        return False
    if not capacity.has_room_joined(tt, len(entries), sum([entry.size for entry in entries])):
        return False
    if tt.counters.runs_failed:
        for gkey, runs_of in spread.items():
            grp = tt.view(gkey)
            if grp is not None and grp.failed and any(entry.uid in grp.failed for entry in runs_of):
                return False
    return True


def split(result: PutResult, pushes: Sequence[Sequence[Entry]], last: dict[str, int]) -> list[PutResult]:
    """A joined push's result as each push's own: its experiences stored (duplicate and stale: none
    where they are joined, `_as_one`), and the groups whose last runs it brought (`last`: each group's
    last push), those it completed and of them those dropped, in the order a push alone gives them."""
    owner = {entry.uid: (at, place) for at, entries in enumerate(pushes) for place, entry in enumerate(entries)}
    parts = [PutResult() for _ in pushes]
    for name in ("stored", "duplicates"):
        for uid in sorted(getattr(result, name), key=owner.__getitem__):
            getattr(parts[owner[uid][0]], name).append(uid)
    for uid in result.stale:  # sorted by uid, as admission.screen gives them
        parts[owner[uid][0]].stale.append(uid)
    for gkey in result.completed_groups:
        parts[last[gkey]].completed_groups.append(gkey)
    for gkey in result.dropped_groups:
        parts[last[gkey]].dropped_groups.append(gkey)
    return parts
