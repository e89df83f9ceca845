"""The integrity checks of a data directory.

`verify` checks one table: every record decodes, every stored payload matches its digest
(taken at push, when the payload was checked), every index, group and counter agrees with
the items, its rollouts held in pieces agree with their heads and counters (core/verbs/pieces.py),
and its datasets of prompts agree with their prompts (ledger_check.py). `scan`
checks the whole directory (its format record, the catalogue of tables, their counters, the leases
and grants, then `verify` on each table), turning whatever a damaged page makes LMDB or
a decoder raise into a problem naming where it is: `expbuf check` prints them. `at_open`
is what a server checks before it serves a directory: all of `scan` but the entries of no
table and the chunk sets of no payload (which nothing reads: `expbuf repair` drops the sets, and
removes the pending groups whose heads, or records, are lost or do not decode),
since a damaged record or payload it let through would come back to a trainer as an error or,
worse, as wrong data; it raises Damaged naming the first problem and `expbuf check`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import lmdb

from ..core.table_state.counters import read_counters
from ..core.table_state.state import TableState
from ..core.verbs import leases, pieces, retire
from ..core.verbs.rows import deletes as row_deletes
from ..core.whole_table.verify import records
from ..disk import chunked, layout, shared_prompts
from ..ledger.check import verify_ledger
from ..rules import value_records
from ..rules.extensions import Extensions
from ..schema.errors import DAMAGE, Damaged
from ..schema.table_config import TableConfig

_SHOWN = 20  # problems shown per table at most; the count says how many more
REPAIR = "expbuf repair"  # the command that drops what nothing reads (stray_sets)


def at_open(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], path: Path, now: float, *, full: bool = True
) -> None:
    """Refuse a damaged directory before it is served: raises Damaged naming the first problem.

    `full` checks every record, digest, index and counter (a read of the whole file); without
    it only the directory's own records: format, catalogue, counters, leases and grants."""
    found = scan(txn, dbs, now, strays=False, tables=full)
    problems = [(where, problem) for where, listed in found.items() for problem in listed]
    if problems:
        where, first = problems[0]
        more = f" and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        place = f"table {where}: " if where else ""
        raise Damaged(path, f"{place}{first}{more}")


def scan(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    now: float,
    *,
    strays: bool = True,
    tables: bool = True,
    reopen: Callable[[], lmdb.Transaction[bytes]] | None = None,
) -> dict[str, list[str]]:
    """Every problem of the directory, by table name ("" for the directory's own records);
    `strays` also counts what nothing reads (the entries that belong to no table, the tables' stray
    chunk sets), and `tables` checks each table's
    items, digests, indexes and counters. LMDB ends a transaction in which it met a damaged page:
    with `reopen` (a new read transaction), what comes after such damage is read in one of its
    own, not reported as that transaction's end (BadTxnError) where it has no damage of its own."""
    report: dict[str, list[str]] = {"": []}
    catalogue: dict[str, tuple[int, TableConfig]] = {}
    try:
        older = older_format(txn, dbs)
        if older is not None:  # its records are in a form these checks do not read
            report[""].append(f"the directory has format {older}: a server brings it to {layout.FORMAT} at its start")
            return report
        _directory(txn, dbs, catalogue, report[""])
        if strays:
            report[""] += _strays(txn, dbs, catalogue)
    except DAMAGE as exc:
        report[""].append(f"LMDB or a record raised {type(exc).__name__}: {exc}")
        if isinstance(exc, lmdb.Error) and reopen is not None:
            txn = reopen()
    for name, (table_id, config) in catalogue.items() if tables else ():
        try:
            problems = verify(TableState(txn, dbs, table_id, config, now, Extensions()), strays=strays)
        except DAMAGE as exc:
            problems = [f"reading it raised {type(exc).__name__}: {exc}"]
            if isinstance(exc, lmdb.Error) and reopen is not None:
                txn = reopen()
        report[name] = problems[:_SHOWN] + (
            [f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else []
        )
    return report


def quarantined(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> dict[str, int]:
    """The experiences each table holds quarantined (quarantine.py): damage found and dealt with
    when they were read, which `expbuf check` reports as known, not as a problem. Tables whose
    catalogue entry or counters do not decode are left out (`scan` reports them)."""
    known = {}
    for key, value in txn.cursor(db=dbs["tables"]):
        try:
            prefix = layout.table_prefix(int(json.loads(value)["id"]))
            known[bytes(key).decode()] = read_counters(txn, dbs, prefix).quarantined
        except DAMAGE:
            continue
    return known


def older_format(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int | None:
    """The format of a directory an earlier release wrote, which a server brings up to date at
    its next start; None for the current format, a new directory or a damaged format record."""
    raw = txn.get(b"format", db=dbs["meta"])
    if raw is None:
        return 1 if layout.unrecorded_format(txn, dbs) == 1 else None
    return int(raw) if raw.isdigit() and 0 < int(raw) < layout.FORMAT else None


def newer_format(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int | None:
    """The format of a directory a later release wrote, which this one does not read (its server
    refuses it; its check and repair must not take it for damage); None for any other."""
    raw = txn.get(b"format", db=dbs["meta"])
    return int(raw) if raw is not None and raw.isdigit() and int(raw) > layout.FORMAT else None


def _directory(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    tables: dict[str, tuple[int, TableConfig]],
    problems: list[str],
) -> None:
    """The format record, the catalogue, each table's counters, the leases and the grants."""
    raw = txn.get(b"format", db=dbs["meta"])
    if raw is not None and (not raw.isdigit() or int(raw) != layout.FORMAT):
        problems.append(f"the format record is {bytes(raw)[:20]!r}, not {layout.FORMAT}")
    if raw is None and layout.unrecorded_format(txn, dbs) is None:
        problems.append(f"the format record ({layout.FORMAT}) is gone from a directory of tables of a format after 1")
    next_id = txn.get(b"next_table_id", b"1", db=dbs["meta"])
    if not next_id.isdigit():
        problems.append(f"the next table id is {bytes(next_id)[:20]!r}, not a number")
    for key, value in txn.cursor(db=dbs["tables"]):
        try:
            name, record = bytes(key).decode(), json.loads(value)
            table_id, config = int(record["id"]), TableConfig.from_stored(record["config"], record.get("v", 1))
        except Exception as exc:  # the catalogue's entries are JSON: any decoding error means damage
            problems.append(f"the catalogue entry {bytes(key)[:60]!r} does not decode ({type(exc).__name__}: {exc})")
            continue
        if config.name != name or any(table_id == known for known, _ in tables.values()):
            problems.append(f"the catalogue entry {name!r} names table {config.name!r}, id {table_id}")
            continue
        try:
            read_counters(txn, dbs, layout.table_prefix(table_id))
        except (ValueError, TypeError) as exc:
            problems.append(f"the counters of table {name!r} do not decode ({exc})")
            continue
        tables[name] = (table_id, config)
    problems += leases.undecodable(txn, dbs)
    for key, value in txn.cursor(db=dbs["grants"]):
        try:
            json.loads(value)
        except ValueError as exc:
            problems.append(f"grant {bytes(key)[:60]!r} does not decode ({exc})")


def _strays(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], tables: dict[str, tuple[int, TableConfig]]
) -> list[str]:
    known = {layout.table_prefix(table_id) for table_id, _ in tables.values()}
    problems = []
    for name in layout.per_table(dbs):
        strays = sum(1 for key in txn.cursor(db=dbs[name]).iternext(values=False) if bytes(key[:4]) not in known)
        if strays:
            problems.append(f"{strays} entries of the {name} database belong to no table")
    return problems


def verify(tt: TableState, *, strays: bool = True) -> list[str]:
    """The problems found in one table; [] when consistent. `strays` also counts what nothing reads,
    which at_open leaves out as it does the entries of no table: its chunk sets of no payload
    (stray_sets), and its rollouts held in pieces whose group is complete (pieces.stranded)."""
    problems = records(tt) + _check_chunk_sets(tt, strays=strays)
    problems += pieces.verify(tt) + (pieces.stranded(tt) if strays else []) + value_records.verify(tt)
    return problems + shared_prompts.check(tt.txn, tt.db, tt.prefix) + verify_ledger(tt)


def _check_chunk_sets(tt: TableState, *, strays: bool) -> list[str]:
    """Every chunk set is a stored payload's (its head names it) or a push's that is staging it
    (one that a stop cut short is dropped by the next start), and a set an intact head names is
    marked with that head's key (chunk_heads.OWNER). `strays` also counts the sets that are neither."""
    found, unmarked = chunked.chunk_sets(tt.txn, tt.db, tt.prefix)
    problems = [f"{unmarked} chunk set(s) are not marked as their experience's"] if unmarked else []
    if strays and found:
        problems.insert(0, f"{len(found)} chunk set(s) belong to no stored payload and to no push: {REPAIR} drops them")
    return problems


def repair(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], now: float) -> dict[str, list[str]]:
    """What `expbuf repair` does: drop every table's stray chunk sets (stray_sets), which nothing
    reads, count its shared prompts again as its runs refer to them (dropping those none does:
    shared_prompts.recount), and remove the pending or computing groups whose heads (a records
    table's: group records) do not decode or are lost (row_deletes.remove_damaged_groups,
    retire.remove_lost_groups), which nothing can end, as a Delete naming them does (its
    extensions not loaded: a prompt claimed for such a group waits for its claim to end). What
    it did, by table, a line each. Tables whose catalogue entry or counters do not decode are
    left alone (`scan` reports them)."""
    catalogue: dict[str, tuple[int, TableConfig]] = {}
    _directory(txn, dbs, catalogue, [])
    repaired = {}
    for name, (table_id, config) in catalogue.items():
        tt = TableState(txn, dbs, table_id, config, now, Extensions())
        strays = stray_sets(tt)
        for set_id in sorted(strays):
            chunked.drop_set(txn, dbs, tt.prefix, set_id)
        done = [f"dropped {len(strays)} stray chunk set(s)"] if strays else []
        recounted = shared_prompts.recount(txn, dbs, tt.prefix)
        done += [f"counted {recounted} shared prompt(s) again as their runs refer to them"] if recounted else []
        rows = config.storage.layout == "rows"
        removed = row_deletes.remove_damaged_groups(tt) if rows else retire.remove_lost_groups(tt)
        if removed:
            tt.save()
        done += [
            f"removed group {gkey}, whose record {why}, with {count} experience(s)" for gkey, count, why in removed
        ]
        if done:
            repaired[name] = done
    return repaired


def stray_sets(tt: TableState) -> set[int]:
    """The table's chunk sets that no head names, no push stages and no stored payload is marked
    as owning (a damaged head's set is its, found by its mark, chunk_heads.OWNER): what damage
    before data format 9 may leave, where its upgrade could not tell which head a set is
    (chunked.reseal_heads), and a quarantined head's unmarked set. Nothing reads them; `expbuf
    repair` drops them."""
    return chunked.chunk_sets(tt.txn, tt.db, tt.prefix)[0]
