"""`expbuf check`, `expbuf repair` and `expbuf backup`: a data directory read (its records, payloads,
indexes and counters checked), mended where nothing reads what it drops, and copied as it stands at
one moment. Check and repair want the server stopped; a backup is made beside it. They open the
directory themselves, through the store's face; its modules load for these commands alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from . import CommandError

if TYPE_CHECKING:  # the store's modules load for these commands only
    import lmdb

    from ..store import Environment


class NewerFormat(CommandError):
    """A directory a later release wrote, which this one does not read: not damaged."""


def add_datadir_commands(sub: argparse._SubParsersAction) -> None:
    """`check`, `backup` and `repair`, each with its options."""
    check = sub.add_parser("check", help="verify a data directory (the server must be stopped)")
    check.add_argument("--data", default="./expbuf-data", help="the data directory to verify (default %(default)s)")
    check.set_defaults(func=_check_command)
    backup = sub.add_parser(
        "backup", help="copy a data directory as it stands at one moment (its server running or not), then check it"
    )
    backup.add_argument("target", help="a new or empty directory to copy into")
    backup.add_argument("--data", default="./expbuf-data", help="the data directory to copy (default %(default)s)")
    backup.add_argument("--no-check", action="store_true", help="do not check the copy (expbuf check) once made")
    backup.set_defaults(func=_backup)
    repair = sub.add_parser(
        "repair",
        help=(
            "drop the stray chunk sets and damaged pending groups expbuf check names, and count shared prompts "
            "again as their runs refer to them (the server must be stopped)"
        ),
    )
    repair.add_argument("--data", default="./expbuf-data", help="the data directory (default %(default)s)")
    repair.set_defaults(func=_repair)


def _holds_data(directory: str, command: str) -> None:
    """Refuse, before anything opens it, a directory that holds no expbuf data."""
    data = Path(directory) / "data.mdb"
    if not data.is_file():
        raise CommandError(f"{directory} holds no expbuf data (no data.mdb); nothing to {command}")
    if not data.stat().st_size:
        raise CommandError(f"{directory} holds no expbuf data (data.mdb is empty); nothing to {command}")


def _apart(command: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`fn(args)` in a child process of its own, its exit code the command's: a damaged page can point
    LMDB's reads past the end of data.mdb, which ends the process with SIGBUS (no exception to catch),
    and `expbuf check` was killed with no word where it exists to name the damage. A child killed
    so is damage found: said in one line, exit 1. A refusal (CommandError) is the command's, as main
    says it."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile("w+", buffering=1) as out, tempfile.TemporaryFile("w+", buffering=1) as err:
        pid = os.fork()
        if pid == 0:  # the child: its own exit code, whatever happens; its lines to the parent's files
            code = 2
            sys.stdout, sys.stderr = out, err
            try:
                code = fn(args)
            except CommandError as exc:
                print(f"expbuf {command}: {exc}", file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        for written, to in ((out, sys.stdout), (err, sys.stderr)):  # the caller's own streams (a test's too)
            written.seek(0)
            to.write(written.read())
    if os.WIFSIGNALED(status):
        killed = signal.Signals(os.WTERMSIG(status)).name
        print(
            f"(directory): damaged (reading it ended with {killed}: a damaged page points past the end of data.mdb); "
            "restore it from a backup"
        )
        return 1
    return os.waitstatus_to_exitcode(status)


def _check_command(args: argparse.Namespace) -> int:
    return _apart("check", _check, args)


def _check_copy(args: argparse.Namespace) -> int:
    """A backup's check of its copy: a directory a later release wrote is copied and not checked (a
    backup before a rollback to this release), saying so."""
    try:
        return _check(args)
    except NewerFormat as exc:
        print(f"not checked: {exc}")
        return 0


def _check(args: argparse.Namespace) -> int:
    """Verify the directory's records, payloads, indexes and counters; exit 1 naming what is damaged.

    It opens LMDB read-only without its lock file and writes nothing, so it also checks a
    read-only copy (a backup, a snapshot); a running server's directory is refused.
    """
    _holds_data(args.data, "check")
    import time

    import lmdb

    from ..store import Environment, quarantined_by_table, scan_directory
    from ..store.schema.errors import Damaged, StoreError

    try:
        environment = Environment(args.data, readonly=True)
    except Damaged as exc:
        print(f"(directory): damaged ({exc.damage})")
        return 1
    except (StoreError, lmdb.Error) as exc:
        raise CommandError(f"{args.data}: {exc}") from None
    try:
        with environment.read() as txn, contextlib.ExitStack() as later:
            _refuse_newer(environment, txn, "check")
            upgrade = _upgrade_only(environment, txn)
            if upgrade:  # not damage: what the next start brings up to date
                print(f"{args.data}: {upgrade}")
                return 0
            if environment.missing:
                print(f"(directory): damaged (no {', '.join(environment.missing)} database(s))")
                return 1
            report = scan_directory(
                txn, environment.db, time.time(), reopen=lambda: later.enter_context(environment.read())
            )
        try:  # a transaction of its own: LMDB ends one a damaged page failed (the scan names that damage)
            with environment.read() as txn:
                known = quarantined_by_table(txn, environment.db)
        except lmdb.Error:
            known = {}
    finally:
        environment.close()
    for name, problems in report.items():
        if name or problems:
            verdict = "ok" if not problems else f"{len(problems)} problem(s)"
            if known.get(name):  # damage found when read, and quarantined: known, not a problem
                verdict += f" ({known[name]} experience(s) quarantined: damaged, never served)"
            print(f"{name or '(directory)'}: {verdict}")
        for problem in problems:
            print(f"  {problem}")
    return 1 if any(report.values()) else 0


def _backup(args: argparse.Namespace) -> int:
    """Copy the data directory as it stands at one moment, a server writing it or not (the store's
    copy_directory), then check the copy as `expbuf check` does (unless --no-check): exit 1 where
    the check finds damage, which was in the directory copied. A directory a later release wrote
    is copied and not checked (a backup before a rollback to this release), saying so."""
    _holds_data(args.data, "back up")
    from ..store import copy_directory
    from ..store.schema.errors import StoreError

    try:
        size = copy_directory(Path(args.data), Path(args.target))
    except StoreError as exc:
        raise CommandError(str(exc)) from None
    print(f"copied {args.data} to {args.target}: {size} bytes")
    return 0 if args.no_check else _apart("backup", _check_copy, argparse.Namespace(data=args.target))


def _repair(args: argparse.Namespace) -> int:
    """Drop what nothing reads, which `expbuf check` names with this command: chunk sets of no
    stored payload, and remove what nothing can end: a rows table's pending or computing groups
    whose heads do not decode (expbuf.server.store.repair_directory). It changes nothing else: a
    directory a release before this one wrote is left to `expbuf serve` to bring up to date first;
    one whose own records (format, databases, catalogue, counters, leases, grants) are damaged, and
    a running server's, are refused."""
    _holds_data(args.data, "repair")
    import time

    import lmdb

    from ..store import Environment, repair_directory, scan_directory
    from ..store.schema.errors import StoreError

    def current_only(txn: lmdb.Transaction[bytes], _env: object, dbs: dict[str, lmdb._Database], _path: Path) -> None:
        damage = scan_directory(txn, dbs, time.time(), strays=False, tables=False)[""]
        if damage:  # looked at again: a server may have run since
            raise StoreError(f"damaged ({damage[0]}): {_CHECK}")

    try:
        reader = Environment(args.data, readonly=True)
        try:
            with reader.read() as txn:
                _refuse_newer(reader, txn, "repair")
                upgrade = _upgrade_only(reader, txn)
                damage = (
                    [f"no {', '.join(reader.missing)} database(s)"]
                    if reader.missing
                    else scan_directory(txn, reader.db, time.time(), strays=False, tables=False)[""]
                )
        finally:
            reader.close()
        if upgrade:
            raise CommandError(f"{args.data}: {_FIRST} ({upgrade})")
        if damage:  # what repair reads to find the strays must be whole
            raise CommandError(f"{args.data}: damaged ({damage[0]}): {_CHECK}")
        environment = Environment(args.data, migrate=current_only)
        try:
            repaired = environment.submit(lambda txn: repair_directory(txn, environment.db, time.time()))
        finally:
            environment.close()
    except (StoreError, lmdb.Error) as exc:
        raise CommandError(f"{args.data}: {exc}") from None
    for name, lines in repaired.items():
        for line in lines:
            print(f"{name}: {line}")
    if not repaired:
        print("no stray chunk sets")
    return 0


# Why repair refuses a directory that needs bringing up to date, or is damaged: it changes nothing
# but the strays, and finds them from the directory's own records.
_FIRST = "run expbuf serve once to bring it up to date, then expbuf repair"
_CHECK = "expbuf check names the damage; expbuf repair drops only what nothing reads"


def _refuse_newer(environment: Environment, txn: lmdb.Transaction[bytes], command: str) -> None:
    """Refuse a directory a later release wrote, as `expbuf serve` does: it is not damaged."""
    from ..store import FORMAT, newer_format

    newer = newer_format(txn, environment.db) if "meta" in environment.db else None
    if newer is not None:
        raise NewerFormat(
            f"{environment.path}: data directory format {newer}, newer than this expbuf reads (up to {FORMAT}): "
            f"{command} it with the release that wrote it, or a newer one"
        )


def _upgrade_only(environment: Environment, txn: lmdb.Transaction[bytes]) -> str | None:
    """What the next `expbuf serve` brings up to date in a directory that needs nothing else
    (an earlier release's format, or the index of an order registered since), or None."""
    from ..store import FORMAT, index_databases, older_format

    older = older_format(txn, environment.db) if {"meta", "tables"} <= environment.db.keys() else None
    if older is not None:
        return (
            f"data directory format {older}, which the next expbuf serve upgrades to format {FORMAT};"
            " run expbuf check after that to check its tables"
        )
    if environment.missing and set(environment.missing) <= set(index_databases()):
        missing = ", ".join(environment.missing)
        return f"no {missing} database(s), the index of a registered order: the next expbuf serve builds it"
    return None
