"""The prompt ledger's part of `expbuf check` (integrity.py): a table's datasets agree with
their prompts and with the table's groups, so that a crash that left them apart is reported.

Every dataset and prompt record decodes and names an (epoch, index) of its dataset; each
epoch's counts by state, and the dataset's totals, are its prompt records in that state; a claimed prompt's claim is in
the expiry index, which holds nothing else; a prompt sent back and not claimed again is in
its dataset's queue once, and the queue holds nothing else; the group of a claimed prompt's
attempt is incomplete or not there yet, and a generated prompt's is complete and live.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

from .ledger_records import (
    CLAIMED,
    COUNTED,
    GENERATED,
    PENDING,
    DatasetRecord,
    PromptRecord,
    counts_epoch,
    counts_prefix,
    datasets_prefix,
    decode_counts,
    expiry_key,
    expiry_prefix,
    group_key,
    prompt_of,
    prompts_prefix,
    queue_prefix,
    unplace,
)
from .records import LIVE
from .records import PENDING as GROUP_PENDING
from .table_state import TableState


def _entries(tt: TableState, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    with tt.txn.cursor(db=tt.db["ledger"]) as cur:
        found = cur.set_range(prefix)
        while found and bytes(cur.key()).startswith(prefix):
            yield bytes(cur.key()), bytes(cur.value())
            found = cur.next()


def verify_ledger(tt: TableState) -> list[str]:
    """The problems of a table's datasets; [] when they agree with their prompts and groups."""
    problems: list[str] = []
    claims = 0
    for key, raw in _entries(tt, datasets_prefix(tt.table_id)):
        try:
            ds = DatasetRecord.decode(raw)
        except Exception as exc:  # a JSON record: any decoding error means damage
            problems.append(f"dataset record {key[5:][:70]!r} does not decode ({type(exc).__name__}: {exc})")
            continue
        found, dataset_claims = _prompts(tt, ds, problems)
        claims += dataset_claims
        _counts(tt, ds, found, problems)
    expiries = sum(1 for _ in _entries(tt, expiry_prefix(tt.table_id)))
    if expiries != claims:
        problems.append(f"the claims' expiry index holds {expiries} entries for {claims} claimed prompts")
    return problems


def _counts(tt: TableState, ds: DatasetRecord, found: dict[int, Counter[str]], problems: list[str]) -> None:
    """Each epoch's counts, and the dataset's totals, against the prompt records found."""
    for state in COUNTED:
        records = sum(row[state] for row in found.values())
        if ds.total(state) != records:
            problems.append(
                f"dataset {ds.name}: its totals count {ds.total(state)} {state} prompts, but {records} were found"
            )
    unseen = {epoch for epoch, row in found.items() if +row}
    for key, raw in _entries(tt, counts_prefix(tt.table_id, ds.name)):
        epoch = counts_epoch(key)
        if epoch >= ds.epochs:
            problems.append(f"dataset {ds.name}: counts for epoch {epoch}, but it has {ds.epochs} epochs")
            continue
        unseen.discard(epoch)
        row = decode_counts(raw)
        for state in COUNTED:
            if row.get(state, 0) != found[epoch][state]:
                problems.append(
                    f"dataset {ds.name}: epoch {epoch} counts {row.get(state, 0)} {state} prompts, "
                    f"but {found[epoch][state]} were found"
                )
    for epoch in sorted(unseen):
        problems.append(f"dataset {ds.name}: epoch {epoch} has no counts, but prompts {dict(found[epoch])} were found")


def _prompts(tt: TableState, ds: DatasetRecord, problems: list[str]) -> tuple[dict[int, Counter[str]], int]:
    """One dataset's prompt records checked; their counts by epoch and state, and the claims."""
    found: dict[int, Counter[str]] = defaultdict(Counter)
    pending: set[tuple[int, int]] = set()
    claims = 0
    for key, raw in _entries(tt, prompts_prefix(tt.table_id, ds.name)):
        epoch, index = prompt_of(key)
        where = f"dataset {ds.name}: prompt {epoch}/{index}"
        try:
            rec = PromptRecord.decode(raw)
        except Exception as exc:  # a packed record: a damaged one raises struct.error, IndexError, ...
            problems.append(f"{where}: its record does not decode ({type(exc).__name__}: {exc})")
            continue
        if epoch >= ds.epochs or index >= ds.size:
            problems.append(f"{where} is outside its {ds.epochs} epochs of {ds.size} prompts")
            continue
        found[epoch][rec.state] += 1
        grp = tt.group(group_key(ds.name, epoch, index, rec.attempt))
        if rec.state == CLAIMED:
            claims += 1
            if tt.txn.get(expiry_key(tt.table_id, rec.expires, ds.name, epoch, index), db=tt.db["ledger"]) is None:
                problems.append(f"{where} is claimed (attempt {rec.attempt}) but its claim is not in the expiry index")
            if grp is not None and grp.state != GROUP_PENDING:
                problems.append(f"{where} is claimed, but the group of attempt {rec.attempt} is {grp.state}")
        elif rec.state == PENDING:
            pending.add((epoch, index))
        elif rec.state == GENERATED and (grp is None or grp.state not in LIVE or grp.state == GROUP_PENDING):
            state = "not there" if grp is None else grp.state
            problems.append(f"{where} is generated, but the group of attempt {rec.attempt} is {state}")
    queued = Counter(unplace(value) for _, value in _entries(tt, queue_prefix(tt.table_id, ds.name)))
    if set(queued) != pending or any(count > 1 for count in queued.values()):
        extra, missed = sorted(set(queued) - pending)[:3], sorted(pending - set(queued))[:3]
        problems.append(
            f"dataset {ds.name}: its queue of prompts sent back holds {sum(queued.values())} entries for "
            f"{len(pending)} such prompts (not sent back: {extra}; missing: {missed})"
        )
    return found, claims
