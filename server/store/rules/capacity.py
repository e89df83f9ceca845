"""A table's capacity in experiences and bytes: a push that would pass it evicts the
oldest ready groups (evict mode) or is refused (block mode: the pusher may wait for room;
a push larger than the capacity on its own is refused at once). The pieces of rollouts held in
pieces count in its bytes (a worker whose rollouts never finish cannot fill the disk), a piece
making room as a push does, and so do the table's keyed values (value_records.py), whose put is
refused where it would pass the capacity: no value is evicted, nor an experience for one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..core.table_state.counters import Counters
from ..core.table_state.state import TableState
from ..core.verbs.retire import retire
from ..core.verbs.rows import moves as row_moves
from ..core.whole_table.reading import oldest_groups
from ..schema.errors import TableFull, TooLarge
from ..schema.states import EVICTED, READY
from ..schema.table_config import TableConfig


def held_bytes(counters: Counters) -> int:
    """The bytes a table holds against capacity_bytes: live experiences', rollouts in pieces',
    keyed values'."""
    return counters.bytes + counters.partial_bytes + counters.value_bytes


def room_for_values(cfg: TableConfig, counters: Counters, added: int) -> None:
    """Refuse keyed values that add `added` bytes to a table they would take past capacity_bytes."""
    most = cfg.capacity.bytes
    if not most or added <= 0 or held_bytes(counters) + added <= most:
        return
    if added > most:
        raise TooLarge(
            f"table '{cfg.name}': these values take {added} bytes, more than its capacity_bytes ({most}) on their own"
        )
    raise TableFull(
        f"table '{cfg.name}' has no room for these values ({added} bytes more): it would hold more than its "
        f"capacity_bytes ({most}), with {counters.bytes} bytes of experiences, {counters.partial_bytes} of rollouts "
        f"in pieces and {counters.value_bytes} of keyed values; nothing of this put is stored: clear values, or let "
        "the experiences be consumed"
    )


def make_room(tt: TableState, count: int, nbytes: int, keep: set[str]) -> None:
    """Room for `count` experiences of `nbytes` in the table: evict the oldest ready groups
    (never pending ones, which still take members, nor leased ones) or refuse. A records table's
    oldest are those of its oldest experiences; a rows table's, the first in its ready order (the
    order they completed in: row_moves.evict)."""
    cfg = tt.config

    def over(live: int, held: int) -> bool:
        return _over(cfg, live + count, held + nbytes)

    def over_now() -> bool:
        return over(tt.counters.live(), held_bytes(tt.counters))

    if not over_now():
        return
    if (cfg.capacity.experiences and count > cfg.capacity.experiences) or (
        cfg.capacity.bytes and nbytes > cfg.capacity.bytes
    ):
        raise TooLarge(
            f"table '{cfg.name}': {count} experiences of {nbytes} bytes exceed its capacity "
            f"({cfg.capacity.experiences} experiences, {cfg.capacity.bytes} bytes) on their own"
        )
    if cfg.capacity.when_full == "evict" and cfg.storage.layout == "rows":
        tt.counters.evicted_total += row_moves.evict(tt, over, tt.counters.live(), held_bytes(tt.counters))
        if not over_now():
            return
    elif cfg.capacity.when_full == "evict":
        oldest = (gkey for gkey in oldest_groups(tt) if gkey not in keep)
        while over_now() and _evict(tt, oldest, over):
            pass
        if not over_now():
            return
    raise TableFull(f"table '{cfg.name}' is full ({cfg.capacity.experiences} experiences, {cfg.capacity.bytes} bytes)")


def has_room(tt: TableState, count: int, nbytes: int) -> bool:
    """Whether `count` experiences of `nbytes` fit in the table as it is, nothing evicted."""
    return not _over(tt.config, tt.counters.live() + count, held_bytes(tt.counters) + nbytes)


def _over(cfg: TableConfig, live: int, held: int) -> bool:
    """Whether `live` experiences holding `held` bytes pass the table's capacity."""
    return bool(
        (cfg.capacity.experiences and live > cfg.capacity.experiences)
        or (cfg.capacity.bytes and held > cfg.capacity.bytes)
    )


def _evict(tt: TableState, oldest: Iterator[str], over: Callable[[int, int], bool]) -> bool:
    """Evict, in one step (one Retired event), as many of the `oldest` ready groups as it takes
    for `over` to pass on the counts they leave; whether any was."""
    live, held = tt.counters.live(), held_bytes(tt.counters)
    groups = []
    for gkey in oldest:
        grp = tt.existing_view(gkey)
        if grp.state != READY:  # a pending group still takes members; leased ones are out
            continue
        groups.append((gkey, grp))
        live -= len(grp.members)
        if tt.config.capacity.bytes:  # the members' sizes read only where bytes are bounded
            held -= sum(member.size for uid in grp.members if (member := tt.member(uid)) is not None)
        if not over(live, held):
            break
    if groups:
        retire(tt, groups, EVICTED)
        tt.counters.evicted_total += sum(len(grp.members) for _, grp in groups)
    return bool(groups)
