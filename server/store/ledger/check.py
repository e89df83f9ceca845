"""The prompt ledger's own consistency, one table at a time (integrity.verify runs it at open
and for `expbuf check`).

Each check names a state the ledger's rules never leave behind, and whose damage would lose,
repeat or stall a prompt: a dataset record that does not decode, or whose totals or epochs'
counts disagree with its prompt records; an epoch owning more prompts than it has, or counting
more than it owns; a claim without its expiry key (it would never end) or an expiry key
without its claim; a pending prompt no queue entry names (it would never go out again) or a
queue entry naming a prompt that is not pending; a group entry naming no prompt; a claimed
prompt whose attempt's group is complete, or a generated one whose group is not complete and
live (a crash that left the ledger apart from the table's groups); a negative count; a cursor
out of range; a claim's kept id without its time (claimed.py). Every pass reads the ledger's
keys in order and looks records up by key, so memory grows with the queued prompts and the
epochs with an event, not with the dataset.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from ..core.table_state.state import TableState
from ..disk import layout
from ..schema.states import LIVE
from ..schema.states import PENDING as GROUP_PENDING
from .binned import bins_prefix, read_bin_key
from .claimed import id_problems
from .records import (
    DatasetRecord,
    PromptRecord,
    counts_epoch,
    datasets_prefix,
    decode_counts,
    expiry_key,
    expiry_prefix,
    group_key,
    prompt_key,
    read_expiry_key,
    read_group_entry,
    unplace,
)
from .settings import check
from .states import CLAIMED, COUNTED, GENERATED, PENDING


def verify_ledger(tt: TableState) -> list[str]:
    """The problems of the table's datasets and prompts; [] when consistent."""
    problems: list[str] = []
    datasets = _datasets(tt, problems)
    rows = _epochs(tt, datasets, problems)
    queued = _queue(tt, datasets, problems)
    found = _prompts(tt, datasets, queued, problems)
    for name, ds in datasets.items():
        if ds is not None:
            problems += _counts(ds, rows.get(name, {}), found.get(name, {}))
    _expiries(tt, datasets, problems)
    _groups(tt, datasets, problems)
    _bins(tt, datasets, problems)
    return problems + id_problems(tt)


def _entries(tt: TableState, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    with tt.txn.cursor(db=tt.db["ledger"]) as cur:
        found = cur.set_range(prefix)
        while found and bytes(cur.key()).startswith(prefix):
            yield bytes(cur.key()), bytes(cur.value())
            found = cur.next()


def _name(raw: bytes) -> str:
    return raw.decode(errors="replace")


def _datasets(tt: TableState, problems: list[str]) -> dict[str, DatasetRecord | None]:
    """The table's datasets by name (None: a record that does not decode), each record's
    settings, totals and cursor checked on their own."""
    out: dict[str, DatasetRecord | None] = {}
    prefix = datasets_prefix(tt.table_id)
    for key, value in _entries(tt, prefix):
        name = _name(key[len(prefix) :])
        try:
            ds = DatasetRecord.decode(value)
            if ds.name != name:
                raise ValueError(f"it names dataset {ds.name!r}")
            check(ds, tt.config.grouping.by)
            own = _own(ds)
        except Exception as exc:  # a damaged record may raise anything its decoder does
            problems.append(f"dataset record {name!r} does not decode ({type(exc).__name__}: {exc})")
            out[name] = None
            continue
        problems += own
        out[name] = ds
    return out


def _own(ds: DatasetRecord) -> list[str]:
    """What a dataset record says of itself: no count negative, its totals within the prompts
    it owns, those within its epochs' prompts, the cursor within its epochs."""
    where = f"dataset {ds.name}"
    problems = []
    for name in ("next_seq", "reissued", "attempts_dropped"):
        if getattr(ds, name) < 0:
            problems.append(f"{where}: {name} is {getattr(ds, name)}; a count is never negative")
    if not 0 <= ds.owned_total <= ds.size * ds.epochs:
        problems.append(
            f"{where}: owned_total is {ds.owned_total}; it holds the prompts of all epochs this server hands out,"
            f" 0..{ds.size * ds.epochs}"
        )
    for state, count in ds.totals.items():
        if state not in COUNTED:
            problems.append(f"{where}: its totals count a state {state!r} the ledger does not know")
        elif count < 0:
            problems.append(f"{where}: its totals count {count} {state} prompt(s); a count is never negative")
    if ds.shards and not ds.started <= ds.counted <= ds.epochs:
        problems.append(
            f"{where}: counted is {ds.counted}; its part of each of the {ds.started} epoch(s) started is counted,"
            f" of at most its {ds.epochs}"
        )
    elif not ds.shards and ds.counted != ds.epochs:
        problems.append(f"{where}: counted is {ds.counted}; every one of its {ds.epochs} epoch(s) is counted")
    held = sum(ds.totals.get(state, 0) for state in COUNTED)
    if held > ds.owned_total:
        problems.append(
            f"{where}: its totals count {held} prompt(s) claimed, generated, trained or dropped,"
            f" of its {ds.owned_total}"
        )
    at_end = ds.cursor_epoch == ds.epochs and ds.cursor_position == 0
    if not at_end and not (0 <= ds.cursor_epoch < ds.epochs and 0 <= ds.cursor_position < ds.size):
        problems.append(
            f"{where}: the cursor (epoch {ds.cursor_epoch}, position {ds.cursor_position}) is outside"
            f" its {ds.epochs} epoch(s) of {ds.size} prompt(s)"
        )
    return problems


def _epochs(
    tt: TableState, datasets: dict[str, DatasetRecord | None], problems: list[str]
) -> dict[str, dict[int, dict[str, int]]]:
    """Each dataset's epoch counts records, by epoch: each of one of its epochs, owning `size`
    prompts (a shard's part: at most that), counting no more than it owns; a sharded dataset
    has one for every epoch counted and none after (its part of an epoch is written as the
    epoch starts), and the prompts its epochs own add up to the dataset's owned_total (an
    epoch with no record owns `size`)."""
    rows: dict[str, dict[int, dict[str, int]]] = {}
    owned: dict[str, int] = defaultdict(int)
    orphans: dict[str, int] = defaultdict(int)
    prefix = layout.table_prefix(tt.table_id) + b"c"
    for key, value in _entries(tt, prefix):
        name = _name(key[len(prefix) : -5])
        if name not in datasets:
            orphans[name] += 1
            continue
        ds = datasets[name]
        if ds is None:
            continue
        epoch = counts_epoch(key)
        where = f"dataset {name}: epoch {epoch}"
        try:
            epoch_owned, row = decode_counts(value)
        except Exception as exc:  # a damaged record may raise anything its decoder does
            problems.append(f"{where}: its counts do not decode ({type(exc).__name__}: {exc})")
            continue
        if epoch >= ds.epochs:
            problems.append(f"{where} has counts, but the dataset has {ds.epochs} epoch(s)")
            continue
        rows.setdefault(name, {})[epoch] = row
        owned[name] += epoch_owned
        if epoch_owned > ds.size or (not ds.shards and epoch_owned != ds.size):
            bound = "at most" if ds.shards else "all"
            problems.append(f"{where} owns {epoch_owned} prompt(s); it owns {bound} its {ds.size}")
        if sum(row.values()) > epoch_owned:
            problems.append(
                f"{where} counts {sum(row.values())} prompt(s) claimed, generated, trained or dropped,"
                f" of its {epoch_owned}"
            )
    for name, ds in datasets.items():
        if ds is None:
            continue
        written = rows.get(name, {})
        unwritten = ds.epochs - len(written)
        if ds.shards:
            beyond = sum(epoch >= ds.counted for epoch in written)
            unwritten = ds.counted - (len(written) - beyond)
            if beyond:
                problems.append(f"dataset {name}: {beyond} epoch(s) past the {ds.counted} counted have counts")
        if ds.shards and unwritten:
            problems.append(
                f"dataset {name}: {unwritten} of its {ds.counted} epoch(s) counted have no counts of its part"
            )
        elif owned[name] + unwritten * ds.size != ds.owned_total:
            problems.append(
                f"dataset {name}: its epochs own {owned[name] + unwritten * ds.size} prompt(s),"
                f" but its owned_total is {ds.owned_total}"
            )
    for name, count in orphans.items():
        problems.append(f"{count} epoch counts record(s) of dataset {name!r}, which has no dataset record")
    return rows


def _queue(tt: TableState, datasets: dict[str, DatasetRecord | None], problems: list[str]) -> set[tuple[str, int, int]]:
    """The prompts the queues name; each entry must name a pending prompt, below its
    dataset's next sequence number (a new entry would write over it)."""
    queued: set[tuple[str, int, int]] = set()
    prefix = layout.table_prefix(tt.table_id) + b"q"
    for key, value in _entries(tt, prefix):
        name, seq = _name(key[len(prefix) : -9]), int.from_bytes(key[-8:], "big")
        if name not in datasets:
            problems.append(f"queue entry {seq} of dataset {name!r}, which has no dataset record")
            continue
        ds = datasets[name]
        if ds is None:
            continue
        epoch, index = unplace(value)
        queued.add((name, epoch, index))
        where = f"dataset {name}: queue entry {seq}"
        if seq >= ds.next_seq:
            problems.append(f"{where} is not below the dataset's next sequence number {ds.next_seq}")
        rec = _prompt(tt, name, epoch, index)
        if rec is None:
            problems.append(f"{where} names prompt {epoch}/{index}, which has no readable record")
        elif rec.state != PENDING:
            problems.append(f"{where} names prompt {epoch}/{index}, which is {rec.state}, not pending")
    return queued


def _prompts(
    tt: TableState,
    datasets: dict[str, DatasetRecord | None],
    queued: set[tuple[str, int, int]],
    problems: list[str],
) -> dict[str, dict[int, dict[str, int]]]:
    """Every prompt record, counted by dataset, epoch and state; a claimed one must have its
    expiry key, a pending one a queue entry."""
    found: dict[str, dict[int, dict[str, int]]] = {}
    orphans: dict[str, int] = defaultdict(int)
    prefix = layout.table_prefix(tt.table_id) + b"p"
    for key, value in _entries(tt, prefix):
        name = _name(key[len(prefix) : -13])
        if name not in datasets:
            orphans[name] += 1
            continue
        ds = datasets[name]
        if ds is None:
            continue
        epoch, index = int.from_bytes(key[-12:-8], "big"), int.from_bytes(key[-8:], "big")
        where = f"dataset {name}: prompt {epoch}/{index}"
        try:
            rec = PromptRecord.decode(value)
        except Exception as exc:  # a damaged record may raise anything its decoder does
            problems.append(f"{where}: its record does not decode ({type(exc).__name__}: {exc})")
            continue
        if epoch >= ds.epochs or index >= ds.size:
            problems.append(f"{where} is outside its {ds.epochs} epoch(s) of {ds.size} prompt(s)")
            continue
        counted = found.setdefault(name, {}).setdefault(epoch, defaultdict(int))
        counted[rec.state] += 1
        if epoch > ds.cursor_epoch:
            problems.append(f"{where} has a record, but the cursor is at epoch {ds.cursor_epoch}")
        if rec.state == CLAIMED and (
            not rec.expires
            or tt.txn.get(expiry_key(tt.table_id, rec.expires, name, epoch, index), db=tt.db["ledger"]) is None
        ):
            problems.append(f"{where} is claimed, but its claim has no expiry key")
        if rec.state == PENDING and (name, epoch, index) not in queued:
            problems.append(f"{where} is pending at attempt {rec.attempt}, but no queue entry names it")
        if rec.state in (CLAIMED, GENERATED):
            problems += _group_of(tt, where, group_key(name, epoch, index, rec.attempt), rec)
    for name, count in orphans.items():
        problems.append(f"{count} prompt record(s) of dataset {name!r}, which has no dataset record")
    return found


def _group_of(tt: TableState, where: str, gkey: str, rec: PromptRecord) -> list[str]:
    """A claimed prompt's attempt has an incomplete group, or none yet; a generated one's is
    complete and live (its retirement would have moved the prompt on)."""
    grp = tt.view(gkey)
    if rec.state == CLAIMED and grp is not None and grp.state != GROUP_PENDING:
        return [f"{where} is claimed, but the group of attempt {rec.attempt} is {grp.state}"]
    if rec.state == GENERATED and (grp is None or grp.state not in LIVE or grp.state == GROUP_PENDING):
        state = "not there" if grp is None else grp.state
        return [f"{where} is generated, but the group of attempt {rec.attempt} is {state}"]
    return []


def _counts(ds: DatasetRecord, rows: dict[int, dict[str, int]], found: dict[int, dict[str, int]]) -> list[str]:
    """A dataset's totals, and its counts per epoch and state, against its prompt records."""
    problems = []
    for state in COUNTED:
        in_state = sum(counted.get(state, 0) for counted in found.values())
        if ds.totals.get(state, 0) != in_state:
            problems.append(
                f"dataset {ds.name}: its totals count {ds.totals.get(state, 0)} {state} prompt(s),"
                f" but {in_state} prompt record(s) are {state}"
            )
    for epoch in sorted(set(rows) | set(found)):
        row, records = rows.get(epoch, {}), found.get(epoch, {})
        for state in COUNTED:
            if row.get(state, 0) != records.get(state, 0):
                problems.append(
                    f"dataset {ds.name}: epoch {epoch} counts {row.get(state, 0)} {state} prompt(s),"
                    f" but {records.get(state, 0)} prompt record(s) are {state}"
                )
        if epoch == ds.cursor_epoch and sum(records.values()) > ds.cursor_position:
            problems.append(
                f"dataset {ds.name}: epoch {epoch} holds {sum(records.values())} prompt record(s),"
                f" but its cursor has handed out {ds.cursor_position}"
            )
    return problems


def _expiries(tt: TableState, datasets: dict[str, DatasetRecord | None], problems: list[str]) -> None:
    """Each expiry key must be the claim of a claimed prompt, at the time it ends."""
    for key, _ in _entries(tt, expiry_prefix(tt.table_id)):
        name, epoch, index = read_expiry_key(key)
        if name not in datasets:
            problems.append(f"an expiry key names dataset {name!r}, which has no dataset record")
            continue
        if datasets[name] is None:
            continue
        rec = _prompt(tt, name, epoch, index)
        where = f"dataset {name}: an expiry key names prompt {epoch}/{index}"
        if rec is None:
            problems.append(f"{where}, which has no readable record")
        elif rec.state != CLAIMED:
            problems.append(f"{where}, which is {rec.state}")
        elif layout.micros(rec.expires) != key[5:13]:
            problems.append(f"{where}, whose claim ends at another time")


def _bins(tt: TableState, datasets: dict[str, DatasetRecord | None], problems: list[str]) -> None:
    """A difficulty order's bins must hold the prompts its dataset record counts in them (a bin
    counted short would lose a prompt for the epoch; one counted long would stop the cursor)."""
    held: dict[tuple[str, int, int], int] = defaultdict(int)
    for key, _ in _entries(tt, bins_prefix(tt.table_id)):
        held[read_bin_key(key)] += 1
    counted = {
        (name, int(epoch), bin_): n
        for name, ds in datasets.items()
        if ds is not None
        for epoch, row in ds.binned.items()
        for bin_, n in enumerate(row)
        if n
    }
    for name, epoch, bin_ in sorted(set(held) | set(counted)):
        if name in datasets and datasets[name] is None:
            continue
        has, says = held.get((name, epoch, bin_), 0), counted.get((name, epoch, bin_), 0)
        if has != says:
            problems.append(
                f"dataset {name}: epoch {epoch}'s bin {bin_} holds {has} prompts, and its record counts {says}"
            )


def _groups(tt: TableState, datasets: dict[str, DatasetRecord | None], problems: list[str]) -> None:
    """Each group entry must be keyed by its attempt's group and name a prompt with a record
    that reached that attempt."""
    prefix = layout.table_prefix(tt.table_id) + b"g"
    for key, value in _entries(tt, prefix):
        gkey = _name(key[len(prefix) :])
        try:
            name, epoch, index, attempt = read_group_entry(value)
        except Exception as exc:  # a damaged entry may raise anything its decoder does
            problems.append(f"group entry {gkey} does not decode ({type(exc).__name__}: {exc})")
            continue
        if name not in datasets:
            problems.append(f"group entry {gkey} names dataset {name!r}, which has no dataset record")
            continue
        if datasets[name] is None:
            continue
        where = f"dataset {name}: group entry {gkey}"
        rec = _prompt(tt, name, epoch, index)
        if gkey != group_key(name, epoch, index, attempt):
            problems.append(f"{where} names attempt {attempt} of prompt {epoch}/{index}, another group")
        elif rec is None:
            problems.append(f"{where} names prompt {epoch}/{index}, which has no readable record")
        elif attempt > rec.attempt:
            problems.append(f"{where} names attempt {attempt} of prompt {epoch}/{index}, which is at {rec.attempt}")


def _prompt(tt: TableState, name: str, epoch: int, index: int) -> PromptRecord | None:
    """A prompt's record; None when it has none, or one that does not decode (the pass over
    the prompt records names that one)."""
    raw = tt.txn.get(prompt_key(tt.table_id, name, epoch, index), db=tt.db["ledger"])
    try:
        return None if raw is None else PromptRecord.decode(raw)
    except Exception:  # a damaged record may raise anything its decoder does
        return None
