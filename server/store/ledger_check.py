"""The prompt ledger's own consistency, one table at a time (integrity.verify runs it at open
and for `expbuf check`).

Each check names a state the ledger's rules never leave behind, and whose damage would lose,
repeat or stall a prompt: a dataset record that does not decode or whose counts disagree with
its prompt records; a claim without its expiry key (it would never end) or an expiry key
without its claim; a pending prompt no queue entry names (it would never go out again) or a
queue entry naming a prompt that is not pending; a group entry naming no prompt; a negative
count; a cursor out of range. Every pass reads the ledger's keys in order and looks records up
by key, so memory grows with the queued prompts, not with the dataset.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from . import layout
from .ledger import check
from .ledger_records import (
    CLAIMED,
    PENDING,
    PROMPT_STATES,
    DatasetRecord,
    PromptRecord,
    datasets_prefix,
    expiry_key,
    expiry_prefix,
    group_key,
    prompt_key,
    read_expiry_key,
    read_group_entry,
    unplace,
)
from .table_state import TableState

_COUNTED = PROMPT_STATES[1:]  # a dataset record counts every state but pending


def verify_ledger(tt: TableState) -> list[str]:
    """The problems of the table's datasets and prompts; [] when consistent."""
    problems: list[str] = []
    datasets = _datasets(tt, problems)
    queued = _queue(tt, datasets, problems)
    found = _prompts(tt, datasets, queued, problems)
    for name, ds in datasets.items():
        if ds is not None:
            problems += _counts(ds, found.get(name, {}))
    _expiries(tt, datasets, problems)
    _groups(tt, datasets, problems)
    return problems


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
    settings, counts and cursor checked on their own."""
    out: dict[str, DatasetRecord | None] = {}
    prefix = datasets_prefix(tt.table_id)
    for key, value in _entries(tt, prefix):
        name = _name(key[len(prefix) :])
        try:
            ds = DatasetRecord.decode(value)
            if ds.name != name:
                raise ValueError(f"it names dataset {ds.name!r}")
            check(ds, tt.config.group_by)
            own = _own(ds)
        except Exception as exc:  # a damaged record may raise anything its decoder does
            problems.append(f"dataset record {name!r} does not decode ({type(exc).__name__}: {exc})")
            out[name] = None
            continue
        problems += own
        out[name] = ds
    return out


def _own(ds: DatasetRecord) -> list[str]:
    """What a dataset record says of itself: no count negative, none over the epoch's
    prompts, the cursor within its epochs."""
    where = f"dataset {ds.name}"
    if len(ds.counts) != ds.epochs:
        raise ValueError(f"it counts {len(ds.counts)} epoch(s) of its {ds.epochs}")
    problems = []
    for name in ("next_seq", "reissued", "attempts_dropped"):
        if getattr(ds, name) < 0:
            problems.append(f"{where}: {name} is {getattr(ds, name)}; a count is never negative")
    if len(ds.owned) != ds.epochs or any(owned < 0 or owned > ds.size for owned in ds.owned):
        problems.append(f"{where}: owned is {ds.owned}; it holds each epoch's prompts of this server, 0..{ds.size}")
        return problems
    for epoch, row in enumerate(ds.counts):
        for state, count in row.items():
            if state not in _COUNTED:
                problems.append(f"{where}: epoch {epoch} counts a state {state!r} the ledger does not know")
            elif count < 0:
                problems.append(f"{where}: epoch {epoch} counts {count} {state} prompt(s); a count is never negative")
        held = sum(row.values())
        if held > ds.owned[epoch]:
            problems.append(
                f"{where}: epoch {epoch} counts {held} prompt(s) claimed, generated, trained or dropped,"
                f" of its {ds.owned[epoch]}"
            )
    at_end = ds.cursor_epoch == ds.epochs and ds.cursor_position == 0
    if not at_end and not (0 <= ds.cursor_epoch < ds.epochs and 0 <= ds.cursor_position < ds.size):
        problems.append(
            f"{where}: the cursor (epoch {ds.cursor_epoch}, position {ds.cursor_position}) is outside"
            f" its {ds.epochs} epoch(s) of {ds.size} prompt(s)"
        )
    return problems


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
    for name, count in orphans.items():
        problems.append(f"{count} prompt record(s) of dataset {name!r}, which has no dataset record")
    return found


def _counts(ds: DatasetRecord, found: dict[int, dict[str, int]]) -> list[str]:
    """A dataset's counts per epoch and state against its prompt records."""
    problems = []
    for epoch, row in enumerate(ds.counts):
        records = found.get(epoch, {})
        for state in _COUNTED:
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
