"""A push's experiences join their groups: checked (rewards, eids), told apart from copies already
stored (a retried push's duplicates, another content's conflict), stored, and each group the push
fills completed (groups.Ending) or kept pending. Functions over a table's state
(core/table_state/state.py); the rules of a group's life after its push are groups.py's.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ..core.ordering.ready import Row
from ..core.table_state.events import Inserted, Pushed, Resent
from ..core.table_state.state import TableState
from ..core.verbs import groups as core_groups
from ..core.verbs.rows import pending as row_pending
from ..disk import digests
from ..disk.kinds import Ahead, Compute, Entry, PutResult, group_keys
from ..schema.errors import (
    Conflict,
    DamagedGroup,
    GroupClosed,
    GroupOverfilled,
    InvalidPayload,
    InvalidRequest,
    clip,
)
from ..schema.states import PENDING, RETIRED
from ..schema.table_config import estimator_of
from ..schema.views import GroupView, Members
from .capacity import make_room
from .groups import Ending, too_short
from .pushed_advantages import (
    compute_in_push,
)


def put(
    tt: TableState,
    entries: Sequence[Entry],
    *,
    holder: str,
    compute: Compute | None = None,
    ahead: Ahead | None = None,
) -> PutResult:
    """Store a push: each new experience joins its group, and each group it fills becomes
    ready (or computing). Per-item work is done in passes over the whole push: payloads,
    insertion order and ready indexes are written one database at a time. `holder` is who
    pushes (kinds.Push.holder: the prompt ledger lets only a prompt's claimant push its group).
    With `compute` (the table's advantage computation, where the server gives one), the groups
    it completes get their advantages in its transaction (`ahead`: computed before it;
    compute_in_push)."""
    result = PutResult()
    rows = tt.config.storage.layout == "rows"
    keys = group_keys(entries, tt.config.grouping.by)
    if rows:
        return _put_rows(tt, entries, keys, holder, compute, ahead, result)
    fresh, by_group = _screen(tt, entries, keys, None, result, holder)
    views = {gkey: tt.view(gkey) for gkey in by_group}
    _refuse_headless(tt, [tt.key(gkey) for gkey, grp in views.items() if grp is None], by_group)
    _admit(tt, list(fresh.values()), by_group, holder)
    groups: dict[str, GroupView] = {}
    opened: set[str] = set()  # groups this push starts: not in the pending index yet
    size = tt.config.grouping.size
    for gkey, members in by_group.items():
        grp = views[gkey]
        if grp is None:
            grp = core_groups.new(tt)
            opened.add(gkey)
        elif grp.state != PENDING:
            raise GroupClosed(f"group {gkey} is already complete ({grp.state}); it takes no more experiences")
        if grp.failed:  # a run reported failed, then pushed after all (a retry that worked)
            core_groups.forget_failed(grp, [entry.uid for entry in members])
        _no_overfill(tt, gkey, len(grp.members), grp.failed, len(members))
        groups[gkey] = grp
    make_room(tt, len(fresh), sum([entry.size for entry in fresh.values()]), set(groups), len(opened))
    core_groups.add_members(tt, by_group, groups)
    ending = Ending(tt)
    for gkey, grp in groups.items():
        if size == 0 or len(grp.members) + len(grp.failed) >= size:
            if grp.failed and too_short(tt, grp):
                ending.drop_short(gkey, grp)
                result.dropped_groups.append(gkey)
                continue
            result.completed_groups.append(gkey)
            if not ending.complete(gkey, grp, partial=bool(grp.failed), indexed=gkey not in opened):
                result.dropped_groups.append(gkey)
            else:
                tt.counters.groups_short += bool(grp.failed)
        else:
            if gkey in opened:
                core_groups.pend(tt, gkey, grp)
            core_groups.keep(tt, gkey, grp)
    ready: list[Row] = []
    computing: list[Members] | None = [] if compute is not None else None
    ending.done(ready=ready, computing=computing)
    if computing:
        compute_in_push(tt, computing, ready, compute, ahead)
    tt.ready.add_many(ready)
    return _stored(tt, result, list(fresh))


def _admit(tt: TableState, new: Sequence[Entry], by_group: Mapping[str, Sequence[Entry]], holder: str) -> None:
    """A push's new experiences checked (rewards, eids), and its groups heard of before any is stored
    (a push of pieces alone, or of copies alone, was heard of as such)."""
    _check_rewards(tt, new)
    _check_eids(tt, new)
    if by_group:
        tt.extensions.on_pushed(tt, Pushed(list(by_group), holder))


def _stored(tt: TableState, result: PutResult, stored: list[str]) -> PutResult:
    """A push's end: what it stored counted and heard of, the counters saved."""
    result.stored = stored
    tt.counters.pushed += len(stored)
    tt.counters.duplicates += len(result.duplicates)
    if stored:
        tt.extensions.on_inserted(tt, Inserted(stored))
    tt.save()
    return result


def _by_group(entries: Sequence[Entry], keys: list[str]) -> dict[str, Sequence[Entry]]:
    """The entries by group, in push order, each entry's group key in `keys`. A push of whole groups
    one after the other, all of one size (groups of one among them), is cut in C, no step an entry."""
    order = dict.fromkeys(keys)
    size, rest = divmod(len(keys), len(order)) if order else (0, 1)
    if not rest and (
        size == 1
        or list(itertools.chain.from_iterable(map(itertools.repeat, order, itertools.repeat(size, len(order))))) == keys
    ):
        return dict(zip(order, zip(*[iter(entries)] * size, strict=True), strict=True))
    found: dict[str, list[Entry]] = defaultdict(list)
    for entry, gkey in zip(entries, keys, strict=True):
        found[gkey].append(entry)
    return dict(found)


def _screen(
    tt: TableState,
    entries: Sequence[Entry],
    keys: Sequence[str],
    stored: Mapping[str, bytes] | None,
    result: PutResult,
    holder: str,
) -> tuple[dict[str, Entry], dict[str, list[Entry]]]:
    """A push's new experiences (uid -> entry), and by group, its copies (the same uid and payload
    again, or stored already) its duplicates; a uid pushed or stored with another payload refused
    (Conflict). `stored`: a rows table's stored digests of the push's uids (row_pending.stored); a
    records table's (None) are read from their records."""
    fresh: dict[str, Entry] = {}
    by_group: dict[str, list[Entry]] = defaultdict(list)
    copies: dict[str, None] = {}  # the groups of the duplicates
    for entry, gkey in zip(entries, keys, strict=True):
        known = fresh.get(entry.uid)
        if known is not None:
            if known.digest != entry.digest:
                raise Conflict(f"uid {entry.uid} is in this push twice, with different content: nothing stored")
            same = True
        elif stored is not None:
            digest = stored.get(entry.uid)
            if digest is None:
                fresh[entry.uid] = entry
                by_group[gkey].append(entry)
                continue
            # a tombstone a format-3 directory left keeps the digest of that format through its upgrades
            same = digest == entry.digest or digest == digests.format_3(entry.blob)
        else:
            rec = tt.member(entry.uid)
            if rec is None:
                fresh[entry.uid] = entry
                by_group[gkey].append(entry)
                continue
            # A tombstone left by format 3 keeps the digest of that format (its payload is gone).
            same = rec.digest == entry.digest or (rec.state in RETIRED and rec.digest == digests.format_3(entry.blob))
        if not same:
            raise Conflict(f"uid {entry.uid} already exists with different content")
        result.duplicates.append(entry.uid)
        copies[gkey] = None
    if copies:  # a copy is answered as stored only to whoever may push its group
        tt.extensions.on_resent(tt, Resent(list(copies), holder))
    return fresh, by_group


def _put_rows(
    tt: TableState,
    entries: Sequence[Entry],
    keys: list[str],
    holder: str,
    compute: Compute | None,
    ahead: Ahead | None,
    result: PutResult,
) -> PutResult:
    """A push into a table of layout "rows" (issue 64, whose rows land a step at a time): its copies
    told apart (where the directory holds any of its uids, or it holds one twice), its groups joined,
    completed (with their advantages, or computing), kept pending or dropped as a records table's
    (`put`), the oldest ready groups evicted where it needs room (make_room). A group the push opens is
    not made a `PendingGroup` unless the push leaves it pending: most complete in their push."""
    by_group: Mapping[str, Sequence[Entry]] = _by_group(entries, keys)
    gdir = tt.keys(by_group)  # read, sought and written by this push: encoded once
    held = row_pending.held(tt, gdir)
    uids, admitted = [entry.uid for entry in entries], entries
    twice = len(set(uids)) < len(uids)
    # the groups that stay pending with plain heads, none of their new uids there: no step a group
    stay = None if twice else row_pending.staying(tt, by_group, gdir, held)
    if stay is not None and len(stay.gkeys) == len(by_group):  # every group: nothing else to look at
        return _grow_pending(tt, entries, uids, by_group, stay, holder, result)
    rest, rest_keys = _rest(by_group, gdir, stay)
    # the other groups as the table has them, and the digests of their members stored
    existing, stored = row_pending.stored(tt, rest, rest_keys, held)
    if stored or twice:  # some may be stored already, or pushed twice
        fresh, by_group = _screen(tt, entries, keys, stored, result, holder)
        uids, admitted = list(fresh), list(fresh.values())
        gdir = tt.keys(by_group)
        rest, rest_keys = _rest(by_group, gdir, stay)
    opened = [key for gkey, key in zip(rest, rest_keys, strict=True) if gkey not in existing] if existing else rest_keys
    _refuse_headless(tt, opened, rest)
    _admit(tt, admitted, by_group, holder)
    size = tt.config.grouping.size
    groups = _joining(tt, rest, existing)
    row_pending.opened_by_push(tt, len(rest) - len(groups))
    make_room(tt, len(admitted), sum([entry.size for entry in admitted]), set(), len(rest) - len(groups))
    ending = Ending(tt, held)  # the completing groups' heads, as read above: not read again
    joined = row_pending.joined(tt, by_group)
    if stay is None and not groups and min(map(len, joined.values()), default=size) >= size:  # opens and fills each
        result.completed_groups.extend(joined)
        result.dropped_groups.extend(ending.complete_opened(joined, gdir))
        joined = {}
    elif stay is None and not groups and max(map(len, joined.values()), default=size) < size:  # opens, fills none
        row_pending.open_all(tt, joined, gdir)
        return _stored(tt, result, uids)
    kept: list[row_pending.Kept] = []  # the groups left pending: row_pending.keep_all
    opening: list[str] = []  # those it opens and leaves pending: row_pending.open_all
    for gkey, new in joined.items():
        if gkey not in rest:  # one that `stay` holds: row_pending.grow
            continue
        pending = groups.get(gkey)
        if pending is None:  # opened by this push, none of its runs reported failed
            if size and len(new) < size:
                opening.append(gkey)
                continue
            result.completed_groups.append(gkey)
            if not ending.complete(gkey, row_pending.view_new(tt, gkey, new), partial=False, indexed=False):
                result.dropped_groups.append(gkey)
            continue
        if size and pending.size + len(new) + len(pending.failed) < size:
            kept.append((pending, new))
            continue
        view = row_pending.view(tt, pending, new)
        if pending.failed and too_short(tt, view):
            ending.drop_short(gkey, view)
            result.dropped_groups.append(gkey)
            continue
        result.completed_groups.append(gkey)
        if not ending.complete(gkey, view, partial=bool(pending.failed), indexed=pending.raw is not None):
            result.dropped_groups.append(gkey)
        else:
            tt.counters.groups_short += bool(pending.failed)
    row_pending.keep_all(tt, kept)
    row_pending.open_all(tt, {gkey: joined[gkey] for gkey in opening}, tt.keys(opening))
    if stay is not None:
        row_pending.grow(tt, stay, joined)
    ending.done(compute=compute, ahead=ahead)
    return _stored(tt, result, uids)


def _rest(
    by_group: Mapping[str, Sequence[Entry]], gdir: list[bytes], stay: row_pending.Staying | None
) -> tuple[Mapping[str, Sequence[Entry]], list[bytes]]:
    """A push's groups other than those `stay` holds, with their directory keys (`gdir`'s, in the
    push's order)."""
    if stay is None:
        return by_group, gdir
    staying = set(stay.gkeys)
    others = [(gkey, key) for gkey, key in zip(by_group, gdir, strict=True) if gkey not in staying]
    return {gkey: by_group[gkey] for gkey, _ in others}, [key for _, key in others]


def _grow_pending(
    tt: TableState,
    entries: Sequence[Entry],
    uids: list[str],
    by_group: Mapping[str, Sequence[Entry]],
    found: row_pending.Staying,
    holder: str,
    result: PutResult,
) -> PutResult:
    """A push of runs (`entries`, their `uids`) to pending groups that all stay pending after it, none
    of them stored before (row_pending.staying found so): `_put_rows`' steps for such a push, none a
    group: nothing is refused for its groups (none is opened, complete or overfilled), none completes,
    and their heads are written as they are, not decoded (row_pending.grow)."""
    _admit(tt, entries, by_group, holder)
    make_room(tt, len(entries), sum([entry.size for entry in entries]), set())
    row_pending.grow(tt, found, row_pending.joined(tt, by_group))
    return _stored(tt, result, uids)


def _joining(
    tt: TableState, by_group: Mapping[str, Sequence[Entry]], existing: Mapping[str, row_pending.PendingGroup | None]
) -> dict[str, row_pending.PendingGroup]:
    """Of the groups a push joins, in push order, the pending ones the table has (`existing`), their
    runs pushed now no longer failed; one complete refused (GroupClosed), one the push would overfill
    refused (GroupOverfilled), a group it opens too. Where it opens every group and none is over the
    table's group size, none is looked at."""
    size = tt.config.grouping.size
    groups: dict[str, row_pending.PendingGroup] = {}
    if not existing and (not size or max(map(len, by_group.values()), default=0) <= size):
        return groups  # it opens every group, none of them overfilled
    for gkey, members in by_group.items():
        if gkey not in existing:
            _no_overfill(tt, gkey, 0, {}, len(members))
            continue
        if (found := existing[gkey]) is None:
            state = tt.existing_view(gkey).state
            raise GroupClosed(f"group {gkey} is already complete ({state}); it takes no more experiences")
        grp = found
        if grp.failed:  # a run reported failed, then pushed after all (a retry that worked)
            pushed = {entry.uid for entry in members}
            grp = grp._replace(failed={uid: why for uid, why in grp.failed.items() if uid not in pushed})
        _no_overfill(tt, gkey, grp.size, grp.failed, len(members))
        groups[gkey] = grp
    return groups


def _refuse_headless(tt: TableState, opened: Sequence[bytes], pushed: Mapping[str, Sequence[Entry]]) -> None:
    """A group the push opens (`opened`: their directory keys) whose head (a records table's: its
    record) is lost while its runs are stored (their payloads: a seek a group,
    TableState.holding_payloads) refuses the push, nothing of it stored, as any group a push is
    refused for does: opened again under its key, a rows table's would store a resent run a second
    time and spill over the lost group's fragments, a records table's would leave the runs stored
    out of it, pending for good."""
    headless = tt.holding_payloads(opened, pushed)
    if headless:
        lost = "its head is lost" if tt.config.storage.layout == "rows" else "its record is lost"
        raise DamagedGroup(headless[0], f"{lost}, runs of it stored; `expbuf repair` removes it too", lost=True)


def _no_overfill(tt: TableState, gkey: str, members: int, failed: Mapping[str, str], adding: int) -> None:
    """Refuse `adding` more experiences to a group of `members` and `failed` runs that they would
    overfill (GroupOverfilled)."""
    size = tt.config.grouping.size
    if size and members + len(failed) + adding > size:
        raise GroupOverfilled(
            f"group {gkey} has {members} of {size} experiences"
            + (f" and {len(failed)} runs reported failed" if failed else "")
            + f"; {adding} more would overfill it"
        )


def _check_rewards(tt: TableState, entries: Iterable[Entry]) -> None:
    estimator = tt.config.advantages.estimator
    if estimator == "none":  # no reward is needed
        return
    needs_reward = estimator_of(tt.config).needs_reward
    for entry in entries:
        if entry.reward is not None:
            continue
        if needs_reward or not entry.has_token_rewards:
            raise InvalidRequest(
                f"uid {entry.uid} has no reward; table '{tt.config.name}' computes advantages "
                f"with {estimator}, which needs one" + (" (or token_level_reward)" if not needs_reward else "")
            )


# The group key of an eid whose batch and task are both empty (Trinity-RFT's and expbuf's defaults).
NO_EID = "/"


def _check_eids(tt: TableState, entries: Iterable[Entry]) -> None:
    """A table that groups refuses an experience without an eid: every such experience would
    join one group, which the first group_size of them complete and the next finds closed."""
    by = tt.config.grouping.by
    if by == "none":
        return
    for entry in entries:
        if entry.tid == NO_EID:
            raise InvalidPayload(
                f"uid {clip(entry.uid)} has no eid (its batch and task are empty), and table '{tt.config.name}' groups"
                f" by {by}: give each experience EID(batch=..., task=..., run=...), its group's task and its own run"
                ' (a table of group_by = "none" takes experiences without one)'
            )
