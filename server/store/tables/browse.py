"""Browsing a table: a page of its live experiences in insertion order (`expbuf export`).

Read-only, and bounded per call: a page reads at most `SCAN_PER_ITEM` index entries per
experience it may return, so filters that match little cost a few short pages, never one
long read transaction that holds the map's old pages.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass

import lmdb

from ..core.state import member_state, stored
from ..disk.layout import u64
from ..disk.records import GroupRecord, ItemRecord
from ..schema.states import READY

SCAN_PER_ITEM = 10
_SEQ = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class Listed:
    """One live experience as a page lists it."""

    uid: str
    group: str
    state: str
    version: int | None
    reward: float | None
    times_sampled: int  # a batch still under a lease counts once the lease ends


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Listed]
    next: int  # the insertion sequence the next page starts from
    done: bool  # nothing live lies past this page


def page(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    prefix: bytes,
    *,
    states: Collection[str],
    min_version: int | None,
    max_version: int | None,
    after: int,
    limit: int,
) -> Page:
    """Live experiences from insertion sequence `after` on that pass the filters, at most `limit`."""
    items: list[Listed] = []
    budget = limit * SCAN_PER_ITEM
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix + u64(after))
        while found and cur.key().startswith(prefix):
            seq = _SEQ.unpack(cur.key()[len(prefix) :])[0]
            if len(items) == limit or budget == 0:
                return Page(items, seq, False)
            budget -= 1
            uid = bytes(cur.value())
            rec = ItemRecord.decode(stored(txn, prefix + uid, dbs["items"], "experience"))
            state = rec.state
            if state == READY:  # or leased, as its group says
                state = member_state(
                    rec, GroupRecord.decode(stored(txn, prefix + rec.group.encode(), dbs["groups"], "group"))
                )
            if _passes(rec, state, states, min_version, max_version):
                items.append(Listed(uid.decode(), rec.group, state, rec.version, rec.reward, rec.times_sampled))
            found = cur.next()
            after = seq + 1
    return Page(items, after, True)


def _passes(
    rec: ItemRecord, state: str, states: Collection[str], min_version: int | None, max_version: int | None
) -> bool:
    if states and state not in states:
        return False
    if min_version is None and max_version is None:
        return True
    if rec.version is None:
        return False
    return (min_version is None or rec.version >= min_version) and (max_version is None or rec.version <= max_version)
