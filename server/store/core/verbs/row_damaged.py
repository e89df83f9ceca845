"""A rows table's pending or computing group whose head (its directory entry) no longer decodes,
removed whole by a Delete naming it (row_deletes.py), or by `expbuf repair` with the server stopped
(tables/integrity.repair): nothing else can end such a group, since what it holds cannot be read.

Its head named its members, its fragments' count, its creation time (its key in the pending index)
and its place in the compute queue; without it each is found by the group's key: its fragments
under that key, its rows in the pending index, the compute queue and the index of the oldest among
the table's (a read of each, as long as the table's pending and computing groups), its members as
its fragments' rows and its stored payloads (whose uids begin with the group's key:
TableState.payload_uids). A member whose row was in the head and whose payload is lost too is
nowhere to be found, and stays counted.
"""

from __future__ import annotations

import contextlib
import logging

from ...disk.layout import u64
from ...disk.records import DELETED
from ...disk.rows import PENDING as PENDING_ENTRY
from ...disk.rows import REF, Member, decode_member_rows, directory_entry, fragment_key
from ...schema.errors import DAMAGE
from ...schema.states import COMPUTING, PENDING, State
from ..table_state import oldest_index
from ..table_state.events import Retired
from ..table_state.state import TableState
from ..table_state.views import RowGroup
from . import payloads

log = logging.getLogger("expbuf.store")


def remove(tt: TableState, gkey: str) -> int | None:
    """Group `gkey` removed whole where its directory entry is a pending or computing group's that
    does not decode: returns how many members it had; None where it is no such group (a complete
    group's place that does not decode is not removed: its segment still holds the group)."""
    raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
    if raw is None or raw[0] == REF or _decodes(raw):
        return None
    listed = _listed(tt, gkey)
    if listed is None and raw[0] != PENDING_ENTRY:
        return None
    state, created = listed or (PENDING, tt.now)
    rows = _fragments(tt, gkey)
    found = {row.uid for row in rows}
    rows += [tt.member_from_payload(uid, created) for uid in tt.payload_uids(gkey) if uid not in found]
    oldest_index.group_gone(tt, gkey)
    tt.txn.delete(tt.key(gkey), db=tt.db["gdir"])
    tt.counters.add(state, -len(rows))
    tt.counters.add_groups(state, -1)
    payloads.drop(tt, [tt.key(row.uid) for row in rows], [row.size for row in rows])
    tt.extensions.on_retired(tt, Retired([(gkey, RowGroup(gkey, state, (), created=created))], DELETED))
    log.warning(
        "table %s: %s group %s, whose record did not decode, deleted whole: %d experience(s)",
        tt.config.name, state, gkey, len(rows),
    )  # fmt: skip
    return len(rows)


def remove_undecodable(tt: TableState) -> list[tuple[str, int]]:
    """Every pending or computing group of the table whose head does not decode removed whole
    (`remove`), as `expbuf repair` does with the server stopped: each group's key and how many
    members it had. Its directory is read whole, entry by entry."""
    found, prefix, ref = [], tt.prefix, bytes([REF])
    with tt.txn.cursor(db=tt.db["gdir"]) as cur:
        more = cur.set_range(prefix)
        while more and cur.key()[: len(prefix)] == prefix:
            if cur.value()[:1] != ref and not _decodes(cur.value()):
                found.append(bytes(cur.key()[len(prefix) :]).decode(errors="replace"))
            more = cur.next()
    return [(gkey, count) for gkey in found if (count := remove(tt, gkey)) is not None]


def _decodes(raw: bytes) -> bool:
    """Whether a directory entry decodes: one that does is the group's to end as any other."""
    try:
        directory_entry(raw)
    except DAMAGE:
        return False
    return True


def _listed(tt: TableState, gkey: str) -> tuple[State, float] | None:
    """Whether the pending index (pending, with its creation time) or the compute queue (computing)
    names the group, its row there deleted; None: neither does (a timeout passed over it)."""
    name, prefix = gkey.encode(), tt.prefix
    with tt.txn.cursor(db=tt.db["pending"]) as cur:
        more = cur.set_range(prefix)
        while more and cur.key()[: len(prefix)] == prefix:
            if cur.key()[len(prefix) + 8 :] == name:
                created = int.from_bytes(cur.key()[len(prefix) : len(prefix) + 8], "big") / 1e6
                cur.delete()
                return PENDING, created
            more = cur.next()
    place = tt.queued_place(gkey)
    if place is None:
        return None
    tt.txn.delete(prefix + u64(place), db=tt.db["compute"])
    return COMPUTING, tt.now


def _fragments(tt: TableState, gkey: str) -> list[Member]:
    """The rows of the group's fragments that decode, its fragments deleted."""
    begin = fragment_key(tt.prefix, gkey, 0)[:-4]
    rows: list[Member] = []
    with tt.txn.cursor(db=tt.db["frags"]) as cur:
        more = cur.set_range(begin)
        while more and cur.key()[: len(begin)] == begin:
            if len(cur.key()) != len(begin) + 4:  # another group's, whose key goes on after this one's
                more = cur.next()
                continue
            with contextlib.suppress(DAMAGE):
                rows.extend(decode_member_rows(cur.value()))
            more = cur.delete()
    return rows
