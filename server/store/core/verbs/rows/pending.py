"""A rows table's pending groups (issue 64, 2.8): a group whose runs arrive over many pushes (GRPO's
rollout workers, each pushing its own runs) keeps its head in the group directory (`PendingHead`:
when it opened, a hash of each member's uid, its failed runs, and its latest members' rows), the
rows that spilled from its head as fragments (disk/rows/directory.SPILL_BYTES, members.py) and a row
in the pending index (its timeout's, as a records table's). Here: what a push does to them
(found, opened, joined, kept); what becomes of one that completes or leaves is ends.py's.

What a member of such a group costs beyond one of a group pushed whole: its row written in the
heads each push to the group rewrites (and once more where it spills into a fragment) and its uid's
hash in the head. The heads a push changes are written together, in key order (`keep_all`). The
runs a push brings to pending groups that stay pending after it (`staying`: a GRPO worker's push,
all but the last of a group's runs) are added to their heads' bytes as they are (`grow`), found and
written with no step a group beyond each head's own (where every group of the push is such, none
at all); the groups it opens and leaves pending (the first runs) get their heads and index rows
with no step a group (`open_all`); and the groups it completes have the rows of a head that keeps
them all read without the rest of it decoded (`view`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, cast

from ....disk.kinds import Entry, members
from ....disk.layout import put_rows, u64
from ....disk.rows import PENDING as PENDING_ENTRY
from ....disk.rows import (
    GroupRef,
    Member,
    PendingHead,
    SegmentView,
    SegState,
    fragment_key,
    group_entry,
    member_rows,
    uid_hashes,
)
from ....disk.rows import uid_hash as _uid_hash
from ....schema.states import PENDING
from ...table_state import oldest_index
from ...table_state.pending_reads import missing
from ...table_state.state import TableState
from ...table_state.views import NONE_FAILED, RowGroup, row_groups
from .. import payloads

# A push's new members' rows by group, in push order (`joined`).
Joined = Mapping[str, tuple[Member, ...]]


class PendingGroup(NamedTuple):
    """A rows table's pending group as a push meets it, its members' rows unread (they are read once,
    when it completes or leaves: `view`): its head as stored (None: opened by this request, or not
    decoded: `raw`), its members so far, its failed runs (uid -> reason), when it opened, and its
    head's encoding as a push read it (`stored`; None: opened by this request), which `keep_all`
    adds to where it is PendingHead.plain."""

    key: str
    head: PendingHead | None
    size: int  # its members so far
    failed: Mapping[str, str]
    created: float
    raw: bytes | None = None

    def decoded(self) -> PendingHead | None:
        """Its head, decoded from `raw` where it was not; None: opened by this request."""
        if self.head is None and self.raw is not None:
            entry = group_entry(self.key, self.raw)
            assert isinstance(entry, PendingHead)
            return entry
        return self.head


def held(tt: TableState, keys: Sequence[bytes]) -> dict[bytes, bytes]:
    """The directory entries the table holds of these groups (`keys`: their directory keys), by key,
    read in one call."""
    with tt.txn.cursor(db=tt.db["gdir"]) as cur:
        return dict(cur.getmulti(keys))


class Staying(NamedTuple):
    """Of a push's groups, those that are pending with a plain head keeping its rows itself, and stay
    pending after it, none of their new uids among theirs, as `staying` found them: their keys, their
    directory keys, their heads as stored, and their new members' uids' hashes, each group's joined."""

    gkeys: list[str]
    keys: list[bytes]
    raws: list[bytes]
    hashes: list[bytes]


def staying(
    tt: TableState, pushed: Mapping[str, Sequence[Entry]], keys: Sequence[bytes], held: Mapping[bytes, bytes]
) -> Staying | None:
    """Of the groups a push reaches (each with its entries; `keys`: their directory keys, `held`:
    their directory entries, as `held` reads them), those pending ones whose head is plain and keeps
    its rows itself, that stay pending after the push, none of its uids among the group's
    (PendingHead.staying), for `grow`: found in C over them all but for a step a group to pick them
    out; None where there are none (each group then goes as `stored` reads it). A GRPO worker's push
    of a run to each of hundreds of tasks, all but the last, reaches such groups alone."""
    if not held:  # it opens every group
        return None
    uids = [entry.uid for entries in pushed.values() for entry in entries]
    raws = list(map(held.get, keys))
    found, hashes = PendingHead.staying(raws, list(map(len, pushed.values())), tt.config.grouping.size, uids)
    if not found:
        return None
    names = list(pushed)
    if len(found) == len(names):  # every group: none picked out
        return Staying(names, list(keys), cast("list[bytes]", raws), hashes)
    heads = [raw for raw in (raws[at] for at in found) if raw is not None]  # each is: PendingHead.staying
    return Staying([names[at] for at in found], [keys[at] for at in found], heads, hashes)


def grow(tt: TableState, found: Staying, joined: Joined) -> None:
    """The runs of a push that `staying` found join their pending groups (`joined`: the push's
    members by group, as `joined` made them): each head written with its new members' rows and
    hashes (PendingHead.added), one call a group and none else, the heads put in key order in one
    call; a head whose rows would spill goes as `keep_all` keeps it."""
    new = [joined[gkey] for gkey in found.gkeys]
    rows = member_rows(list(itertools.chain.from_iterable(new)))
    if len(rows) != len(new):  # a run or more a group (a GRPO worker's push: one each, nothing counted)
        rows = _each_group(rows, list(map(len, new)))
    grown = list(map(PendingHead.added, found.raws, rows, found.hashes))
    put_rows(
        tt.txn,
        tt.db["gdir"],
        sorted((key, head) for key, head in zip(found.keys, grown, strict=True) if head is not None),
    )
    if None in grown:
        spilled = [(gkey, raw) for gkey, raw, head in zip(found.gkeys, found.raws, grown, strict=True) if head is None]
        keep_all(tt, [(cast("PendingGroup", _plain_group(gkey, raw)), joined[gkey]) for gkey, raw in spilled])


def open_all(tt: TableState, joined: Joined, keys: Sequence[bytes]) -> None:
    """Groups a push opens and leaves pending (`joined`: their members, as `joined` made them, pushed
    now; `keys`: their directory keys), none of their runs reported failed: their heads with their
    members' rows and hashes (PendingHead.opened), and their rows in the pending index and the index
    of the oldest, as `keep_all` writes each group it opens, made in C over them all with no step a
    group; as `keep_all` writes them where one's rows spill. A GRPO worker's first runs open such
    groups, hundreds a push."""
    if not joined:
        return
    counts = list(map(len, joined.values()))
    flat = list(itertools.chain.from_iterable(joined.values()))
    rows, hashes = member_rows(flat), uid_hashes([member.uid for member in flat])
    made = PendingHead.opened(tt.now, _each_group(rows, counts), _each_group(hashes, counts), counts)
    if made is None:
        keep_all(tt, [(opening(tt, gkey), new) for gkey, new in joined.items()])
        return
    names = list(map(str.encode, joined))
    put_rows(tt.txn, tt.db["pending"], sorted(zip(tt.pending_keys(names, tt.now), itertools.repeat(b""))))
    oldest_index.heads_opened(tt, names, tt.now)
    put_rows(tt.txn, tt.db["gdir"], sorted(zip(keys, made, strict=True)))


def _each_group(parts: list[bytes], counts: list[int]) -> list[bytes]:
    """Parts made a member each (rows, hashes), joined a group each (`counts`: each group's members),
    in C; as they are where each group has one."""
    if len(parts) == len(counts):
        return parts
    cut = itertools.pairwise(itertools.accumulate(counts, initial=0))
    return [b"".join(parts[a:b]) for a, b in cut]


def _plain_group(gkey: str, raw: bytes) -> PendingGroup | None:
    """A pending group as a push meets it where its head is `plain`, not decoded (kept pending by
    `keep_all` or completed by `view` from its bytes); None for any other head (every head `staying`
    picks out is plain)."""
    plain = PendingHead.plain(raw)
    if plain is None:
        return None
    count, created = plain
    return PendingGroup(gkey, None, count, NONE_FAILED, created, raw)


def stored(
    tt: TableState, pushed: Mapping[str, Sequence[Entry]], keys: Sequence[bytes], held: Mapping[bytes, bytes]
) -> tuple[dict[str, PendingGroup | None], dict[str, bytes]]:
    """Of these groups (each with the entries a push brings it; `keys`: their directory keys, `tt.keys`;
    `held`: their directory entries, as `held` reads them), those the table has: pending (a `PendingGroup`) or
    complete (None; computing too); and the stored digests of their members (uid -> digest), for a
    retried push's duplicates (a deleted member's is not): one segment and its state read a segment,
    and a pending or computing group's rows read only where one of the entries' uids' hashes is among
    its head's."""
    found: dict[str, PendingGroup | None] = {}
    digests: dict[str, bytes] = {}
    views: dict[int, tuple[SegmentView, SegState]] = {}
    if not held:  # groups the push opens, all of them
        return found, digests
    raws = list(map(held.get, keys))
    for (gkey, entries), raw in zip(pushed.items(), raws, strict=True):
        if raw is None:
            continue
        plain = _plain_group(gkey, raw) if raw[0] == PENDING_ENTRY else None
        if plain is not None:
            found[gkey] = plain
            if PendingHead.holds(raw, plain.size, [pushed.uid for pushed in entries]):
                digests.update(_pending_digests(tt, gkey, PendingHead.decode(raw)))
            continue
        read = group_entry(gkey, raw)
        if not isinstance(read, PendingHead):
            found[gkey] = None
            digests.update(_segment_digests(tt, views, gkey, read))
            continue
        found[gkey] = (  # pending, or complete and computing (queued)
            None
            if read.queued is not None
            else PendingGroup(gkey, read, len(read.hashes), read.failed, read.created, raw)
        )
        if not set(read.hashes).isdisjoint([_uid_hash(pushed.uid) for pushed in entries]):
            digests.update(_pending_digests(tt, gkey, read))
    return found, digests


def _pending_digests(tt: TableState, gkey: str, entry: PendingHead) -> Iterator[tuple[str, bytes]]:
    """A pending or computing group's members' uids and digests, read from its fragments and head."""
    rows, _, _ = tt.pending_members(gkey, entry)
    return ((member.uid, member.digest) for member in rows)


def _segment_digests(
    tt: TableState, views: dict[int, tuple[SegmentView, SegState]], gkey: str, ref: GroupRef
) -> Iterator[tuple[str, bytes]]:
    """A complete group's kept members' uids and digests, its segment read once a request (`views`)."""
    if ref.seg not in views:
        key = tt.prefix + u64(ref.seg)
        raw, raw_state = tt.txn.get(key, db=tt.db["segs"]), tt.txn.get(key, db=tt.db["sstate"])
        if raw is None or raw_state is None:
            raise missing("segment", f"{ref.seg} of group {gkey}")
        views[ref.seg] = SegmentView(raw), SegState.decode(raw_state)
    view, state = views[ref.seg]
    lo, hi = view.span(ref.group)
    uids_there, digests_there = view.members.uids(lo, hi), view.members.digests(lo, hi)
    return ((uids_there[i - lo], digests_there[i - lo]) for i in state.kept(lo, hi))


def head(tt: TableState, gkey: str) -> PendingHead | None:
    """A pending or computing group's head; None: the group is neither (in a segment, or not there).
    DamagedGroup where its directory entry does not decode."""
    raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
    entry = None if raw is None else group_entry(gkey, raw)
    return entry if isinstance(entry, PendingHead) else None


def opened(tt: TableState, gkey: str) -> RowGroup:
    """A new pending group, counted (neither indexed as pending nor written yet: `keep` writes it)."""
    tt.counters.groups_pending += 1
    return RowGroup(gkey, PENDING, (), created=tt.now)


def opened_by_push(tt: TableState, count: int) -> None:
    """New pending groups a push opens, counted: `keep` writes one (`opening`), unless the push
    completes it (`view_new`)."""
    tt.counters.groups_pending += count


def opening(tt: TableState, gkey: str) -> PendingGroup:
    """A pending group this request opened (counted: `opened_by_push`), as `keep` takes it."""
    return PendingGroup(gkey, None, 0, {}, tt.now)


def open_pending(tt: TableState, gkey: str) -> RowGroup:
    """A new pending group, indexed and written (core/verbs/groups.open_pending's)."""
    grp = opened(tt, gkey)
    keep(tt, gkey, grp)
    return grp


def joined(tt: TableState, by_group: Mapping[str, Sequence[Entry]]) -> dict[str, tuple[Member, ...]]:
    """New experiences join their groups, in push order: their payloads stored and counted pending
    (payloads.py); their rows by group (for `keep`, or for the group's segment: `view`), cut in C
    where the groups are all of one size."""
    seq = tt.counters.next_seq
    entries = list(itertools.chain.from_iterable(by_group.values()))
    payloads.store(tt, entries)
    rows = members(entries, seq, tt.now)
    sizes = list(map(len, by_group.values()))
    if sizes and sizes.count(sizes[0]) == len(sizes):  # a push of whole groups of one size, or of one run each
        return dict(zip(by_group, zip(*[iter(rows)] * sizes[0], strict=True), strict=True))
    cut = itertools.pairwise(itertools.accumulate(sizes, initial=0))
    return {gkey: tuple(rows[a:b]) for gkey, (a, b) in zip(by_group, cut, strict=True)}


def view(tt: TableState, grp: PendingGroup, new: Sequence[Member]) -> RowGroup:
    """A pending group's view with its new members: its earlier ones read from its fragments and head
    (those whose rows damage lost, as TableState.pending_members has them)."""
    if grp.head is None and grp.raw is not None and (read := PendingHead.plain_rows(grp.raw, grp.size)) is not None:
        return RowGroup(grp.key, PENDING, (*read, *new), NONE_FAILED, created=grp.created)
    entry = grp.decoded()
    rows, damaged, lost = ((), frozenset[str](), 0) if entry is None else tt.pending_members(grp.key, entry)
    failed = MappingProxyType(dict(grp.failed))
    return RowGroup(grp.key, PENDING, (*rows, *new), failed, created=grp.created, quarantined=damaged, lost=lost)


def view_new(tt: TableState, gkey: str, rows: Sequence[Member]) -> RowGroup:
    """The view of a pending group this request opened (`opening`) with its members, none of its runs
    reported failed: `view`'s, without a `PendingGroup` made first."""
    return row_groups([gkey], PENDING, [tuple(rows)], tt.now)[0]


def views_new(tt: TableState, joined: Mapping[str, tuple[Member, ...]]) -> list[RowGroup]:
    """`view_new`'s of groups this request opened, each with its members (`joined`'s), at once."""
    return row_groups(joined, PENDING, joined.values(), tt.now)


def keep(tt: TableState, gkey: str, grp: RowGroup | PendingGroup, new: Sequence[Member] = ()) -> None:
    """A pending group changed (members added: `new`; runs reported failed), or opened (then indexed
    as pending): its head written, with its new members' rows."""
    if not isinstance(grp, PendingGroup):
        grp = PendingGroup(gkey, head(tt, gkey), len(grp.rows), grp.failed, grp.created)
    keep_all(tt, [(grp, new)])


# A pending group a request changed, and the members it brings it (none: its failed runs changed).
Kept = tuple[PendingGroup, Sequence[Member]]


def keep_all(tt: TableState, changed: Sequence[Kept]) -> None:
    """`keep`'s of the pending groups one request changed (a GRPO worker's push reaches hundreds, a
    run each): each head, and each new fragment, put in key order in one call a database."""
    heads, fragments, indexed = [], [], []
    for grp, new in changed:
        if grp.head is None and grp.raw is not None and new and not grp.failed:  # a plain head's: not decoded
            added = PendingHead.added(grp.raw, b"".join(member_rows(new)), b"".join(uid_hashes([m.uid for m in new])))
            if added is not None:
                heads.append((tt.key(grp.key), added))
                continue
        entry = grp.decoded()
        if entry is None:
            entry = PendingHead(created=grp.created)
            indexed.append((tt.pending_key(grp.key, entry), b""))
        entry.failed = dict(grp.failed)
        if new and (spilled := add(tt, grp.key, entry, new)) is not None:
            fragments.append(spilled)
        heads.append((tt.key(grp.key), entry.encode()))
    db = tt.db
    for rows, into in ((indexed, db["pending"]), (fragments, db["frags"]), (heads, db["gdir"])):
        rows.sort()
        put_rows(tt.txn, into, rows)


def add(tt: TableState, gkey: str, entry: PendingHead, new: Sequence[Member]) -> tuple[bytes, bytes] | None:
    """New members (some) join a pending group's head (which the caller writes): its next fragment's
    row where they spill from it (PendingHead.add), for the caller to put with it."""
    if not entry.hashes:  # its first member: the group's key in the index of the oldest
        oldest_index.head_changed(tt, gkey, None, new[0].created)
    spilled = entry.add(new)
    return None if spilled is None else (fragment_key(tt.prefix, gkey, entry.fragments - 1), spilled)
