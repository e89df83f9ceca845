"""A table's capacity in experiences and bytes: a push that would pass it evicts the
oldest ready groups (evict mode) or is refused (block mode: the pusher may wait for room;
a push larger than the capacity on its own is refused at once). In a table of groups of a fixed
size, a group takes its group_size places of capacity_experiences when it opens (`reserved`), and
its later runs take none: runs pushed as they finish (GRPO's workers) fill groups whose places
are theirs already, so pending groups never fill a table against their own last runs, which,
refused, would leave them pending for good (nothing pending is evicted). So it is with
capacity_bytes: the push that opens a group makes room for the runs still to come of every open
group as well as for its own, each as large as its own runs are on average (a report of failed
runs or a piece that opens one reserves none), so that the open groups' runs find the room they
need; and a push whose runs only join open groups, refused for bytes where nothing a wait or an
eviction could free is held (only open groups, or ready ones the rate limiter holds back), is let
in: refused, the groups stayed open for good, in block and evict mode alike (runs larger than
their estimate pass the bound so).
The pieces of rollouts held in pieces count in its bytes (a worker whose rollouts never finish
cannot fill the disk), a piece making room as a push does, and so do the table's keyed values
(value_records.py), whose put is refused where it would pass the capacity: no value is evicted,
nor an experience for one."""

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
from .limiter import sample_limit


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


def reserved(tt: TableState) -> int:
    """The places a table's pending groups of a fixed size hold for the runs still to come."""
    size = tt.config.grouping.size
    return max(0, tt.counters.groups_pending * size - tt.counters.pending) if size else 0


def make_room(tt: TableState, runs: int, nbytes: int, keep: set[str], opened: int = 0, closing: int = 0) -> None:
    """Room for a push of `runs` experiences of `nbytes` that opens `opened` groups (counted among
    the table's pending groups already, as are the `closing` ones it opens and ends, which take no
    place: a report of every run of a new group failed): evict the oldest ready groups (never
    pending ones, which still take members, nor leased ones) or refuse. In groups of a fixed size the push takes
    group_size places for each group it opens and none for its runs joining open groups, whose places
    they hold (`reserved`), so a push that opens none is bounded by capacity_bytes alone; otherwise a
    place an experience. A records table's oldest are those of its oldest experiences; a rows
    table's, the first in its ready order (the order they completed in: row_moves.evict)."""
    cfg = tt.config
    size = cfg.grouping.size
    places = opened * size if size else runs
    open_places = reserved(tt) - (opened + closing) * size if places else 0  # the other open groups'
    joining = bool(size and runs and not places)  # runs joining open groups only
    # a push of runs that opens groups: the bytes of the runs still to come of every open group, each
    # as large as this push's on average (a report of failed runs or a piece that opens one brings no
    # run to size them by: a piece's own run is held as its pieces, counted already)
    each = nbytes // runs if size and places and runs else 0
    coming = max(0, open_places + places - runs) * each
    own = max(0, places - runs) * each  # of those, its own groups'

    def over(live: int, held: int) -> bool:
        return _over(cfg, live + open_places + places if places else 0, held + nbytes + coming)

    def over_now() -> bool:
        return over(tt.counters.live(), held_bytes(tt.counters))

    if not over_now():
        return
    if (cfg.capacity.experiences and places > cfg.capacity.experiences) or (
        cfg.capacity.bytes and nbytes + own > cfg.capacity.bytes
    ):
        raise TooLarge(
            f"table '{cfg.name}': {runs} experiences of {nbytes} bytes"
            + (f" opening {opened} groups of {size} places each" if size and places != runs else "")
            + (f" (their runs to come about {own} bytes more)" if own and cfg.capacity.bytes else "")
            + f" exceed its capacity ({cfg.capacity.experiences} experiences, {cfg.capacity.bytes} bytes) on their own"
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
    if joining and not _frees_room(tt):  # nothing a sample or an eviction frees: the open groups' runs end them
        return
    raise TableFull(
        f"table '{cfg.name}' is full: it holds {tt.counters.live()} experiences of {held_bytes(tt.counters)} bytes, "
        f"its capacity is {_capacity(cfg)}, and this push brings {runs} of {nbytes} bytes"
        + (f"; its groups still open hold {open_places} places for their runs to come" if open_places else "")
        + (f" (about {coming} bytes with this push's)" if coming and cfg.capacity.bytes else "")
    )


def _frees_room(tt: TableState) -> bool:
    """Whether the table holds groups that a wait or an eviction may take out of it: leased or
    computing ones, or ready ones that a sample may take now (a ready group the rate limiter holds
    back, min_size_to_sample not reached, waited on the push as the push waited on it, for good)."""
    counters = tt.counters
    if counters.groups_leased or counters.groups_computing:
        return True
    return bool(counters.groups_ready) and sample_limit(tt, 1, samples_wait_for_nothing(tt)) is None  # as a take asks


def _capacity(cfg: TableConfig) -> str:
    """A table's capacity in words: each bound it sets (0 sets none)."""
    bounds = [
        f"{cfg.capacity.experiences} experiences" if cfg.capacity.experiences else "",
        f"{cfg.capacity.bytes} bytes" if cfg.capacity.bytes else "",
    ]
    return " and ".join(bound for bound in bounds if bound)


def has_room(tt: TableState, count: int, nbytes: int, coming: int = 0) -> bool:
    """Whether `count` places and `nbytes` (and `coming` bytes more) fit in the table as it is,
    beside its open groups' places, nothing evicted."""
    return not _over(tt.config, tt.counters.live() + reserved(tt) + count, held_bytes(tt.counters) + nbytes + coming)


def has_room_joined(tt: TableState, count: int, nbytes: int) -> bool:
    """has_room for pushes stored as one (joined_pushes.py), asked with a place an experience: no
    fewer than make_room takes, so what fits here fits there; in groups of a fixed size, with the
    bytes of the runs still to come of the open groups and of a group each of the `count` may
    open, as large as theirs on average: no fewer than make_room's either."""
    size = tt.config.grouping.size
    coming = (reserved(tt) + count * (size - 1)) * nbytes // count if size and count else 0
    return has_room(tt, count, nbytes, coming)


def inserts_wait_for_samples(tt: TableState) -> bool:
    """Whether no insert can come until a sample makes room: a blocking table that holds all it can
    (`holds_all`). The rate limiter then lets samples go, which it would hold until more is
    inserted: each side waiting for the other, for good."""
    return tt.config.capacity.when_full == "block" and holds_all(tt)


def holds_all(tt: TableState) -> bool:
    """Whether the table has no room for a group of the size and bytes of those it holds (group_size,
    else their mean) without evicting, and no open group whose runs may still complete it: what it
    holds is all it can hold at once (capacity_bytes may hold fewer than min_size_to_sample)."""
    return not reserved(tt) and _no_room_for_a_group(tt)


def samples_wait_for_nothing(tt: TableState) -> bool:
    """Whether what the table holds is all a sample can wait for: it holds all it can (holds_all), or,
    evicting, has no room for a group more whatever its open groups (their runs evict others as they
    come: a min_size_to_sample past what capacity_bytes holds was never reached, run-by-run pushes
    keeping a group open at all times)."""
    if tt.config.capacity.when_full == "evict":
        return _no_room_for_a_group(tt)
    return holds_all(tt)


def _no_room_for_a_group(tt: TableState) -> bool:
    """Whether the table has no room, nothing evicted, for a group of the size and bytes of those it
    holds (group_size, else their mean), beside what its open groups hold."""
    cfg, counters = tt.config, tt.counters
    if not (cfg.capacity.experiences or cfg.capacity.bytes):
        return False
    live = counters.live()
    groups = counters.groups_computing + counters.groups_ready + counters.groups_leased
    places = cfg.grouping.size or (-(-live // groups) if groups else 1)
    nbytes = -(-counters.bytes * places // live) if live else 1
    return not has_room(tt, places, nbytes)


def _over(cfg: TableConfig, live: int, held: int) -> bool:
    """Whether `live` places (experiences, and those open groups hold) holding `held` bytes pass the
    table's capacity."""
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
        tombstones = tt.counters.evicted  # a member whose record damage lost is quarantined, not evicted
        retire(tt, groups, EVICTED)
        tt.counters.evicted_total += tt.counters.evicted - tombstones
    return bool(groups)
