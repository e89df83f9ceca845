"""The members of a rows table's pending and computing groups, kept in fragments (issue 64, Deliver 4):
one fragment a request, a block of the members it added to pending groups (GRPO's rollout workers push
one run of each of many tasks, so a push reaches many groups), shared by the groups it reached. Each
group's head names its members' ranges there (`FragmentRef`); a fragment's count row counts the ranges
that name it, and the fragment and its row go when the last such range does (its group completed,
left, or had its members written again by a Delete).

A request's `Fragments` stages the members it adds, one fragment for all the groups it reaches, and
its ranges' counts as they change; `save` writes the fragment, and each count once (a push that
completes 256 groups of 8 runs, each run from another push, reads and writes 8 count rows, not 2,048).
A fragment read is read whole once a request (`rows`): the groups a request completes together read
theirs from the same few fragments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import lmdb

from ...disk.batch_rows import Reader
from ...disk.rows import (
    FragmentRef,
    Member,
    MemberBlock,
    PendingHead,
    decode_count,
    encode_count,
    encode_members,
    fragment_count_key,
    fragment_key,
)
from ...schema.errors import StoreError, clip
from .counters import Counters


def pending_rows(
    reader: Reader,
    dbs: Mapping[str, lmdb._Database],
    prefix: bytes,
    gkey: str,
    refs: Sequence[FragmentRef],
    read: dict[int, list[Member]] | None = None,
) -> list[Member]:
    """A pending or computing group's members, in push order, from the ranges of fragments its head
    names (`refs`), read from `reader` (a table state's transaction, or a reader's such as the scrub's
    or a Get's). With `read` (fragment -> its members), each fragment is read whole once into it, for
    the callers that read many groups' members; without, only the group's ranges are decoded."""
    found: list[Member] = []
    for ref in refs:
        if read is not None and ref.fragment in read:
            members = read[ref.fragment]
        else:
            raw = reader.get(fragment_key(prefix, ref.fragment), db=dbs["frags"])
            if raw is None:
                raise StoreError(
                    f"fragment {ref.fragment} of group {clip(gkey)} is named but not stored: "
                    "run `expbuf check` on the data directory"
                )
            if read is None:
                found.extend(MemberBlock(raw).members(ref.lo, ref.hi))
                continue
            members = read[ref.fragment] = MemberBlock(raw).members()
        if not ref.lo < ref.hi <= len(members):
            raise StoreError(f"group {clip(gkey)} names members {ref.lo} to {ref.hi} of fragment {ref.fragment}")
        found.extend(members[ref.lo : ref.hi])
    return found


class Fragments:
    """One request's fragments of a table: the members it adds to pending groups (`stage`), the
    fragments it reads (`rows`), the ranges that stop naming a fragment (`drop`), written by `save`."""

    __slots__ = ("_counters", "_dbs", "_prefix", "_read", "_refs", "_staged", "_staged_id", "_txn")

    def __init__(
        self, txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, counters: Counters
    ) -> None:
        self._txn, self._dbs, self._prefix, self._counters = txn, dbs, prefix, counters
        self._read: dict[int, list[Member]] = {}
        self._staged: list[Member] = []
        self._staged_id: int | None = None
        self._refs: dict[int, int] = {}  # fragment -> ranges naming it added (fewer when negative)

    def stage(self, members: Sequence[Member]) -> FragmentRef:
        """A group's new members, into this request's fragment: the range that names them."""
        if self._staged_id is None:
            self._staged_id = self._counters.next_fragment
            self._counters.next_fragment += 1
        lo = len(self._staged)
        self._staged.extend(members)
        ref = FragmentRef(self._staged_id, lo, len(self._staged))
        self._refs[ref.fragment] = self._refs.get(ref.fragment, 0) + 1
        return ref

    def drop(self, refs: Iterable[FragmentRef]) -> None:
        """Ranges that name their fragments no more (their group left, or was written anew)."""
        for ref in refs:
            self._refs[ref.fragment] = self._refs.get(ref.fragment, 0) - 1

    def rows(self, gkey: str, head: PendingHead) -> list[Member]:
        """A pending or computing group's members, in push order (`pending_rows`), with those this
        request staged."""
        return self._rows(gkey, head.refs)

    def _rows(self, gkey: str, refs: Sequence[FragmentRef]) -> list[Member]:
        if self._staged_id is not None and any(ref.fragment == self._staged_id for ref in refs):
            self._read[self._staged_id] = self._staged
        return pending_rows(self._txn, self._dbs, self._prefix, gkey, refs, self._read)

    def first_created(self, gkey: str, head: PendingHead) -> float | None:
        """When a group's first member was pushed (None: it has none)."""
        refs = head.refs
        return self._rows(gkey, refs[:1])[0].created if refs else None

    def save(self) -> None:
        """This request's fragment written (unless no range names it any more), and each fragment's count
        of ranges changed: one whose count falls to none goes, with its count row."""
        if not self._refs:  # (a records table's request, and most of a rows table's)
            return
        txn, db, prefix = self._txn, self._dbs["frags"], self._prefix
        staged = self._staged_id
        for fragment, change in sorted(self._refs.items()):
            if not change:
                continue
            key = fragment_count_key(prefix, fragment)
            raw = None if fragment == staged else txn.get(key, db=db)
            count = (0 if raw is None else decode_count(raw)) + change
            if count < 0:
                raise StoreError(f"fragment {fragment} is named by fewer groups than leave it: run `expbuf check`")
            if count:
                txn.put(key, encode_count(count), db=db)
                if fragment == staged:
                    txn.put(fragment_key(prefix, fragment), encode_members(self._staged), db=db)
            elif fragment != staged:
                txn.delete(key, db=db)
                txn.delete(fragment_key(prefix, fragment), db=db)
        self._refs.clear()
        if staged is not None:
            self._read.pop(staged, None)
            self._staged, self._staged_id = [], None
