"""The background scrub: every stored payload compared with the digest taken at its push, and
every piece of a rollout held in pieces with the size and digest its rollout's head took at its
push, at a bounded rate, after the store opens and again every `interval_seconds`, as ZFS and Ceph
scrub.

A start checks only the directory's structure (integrity.at_open, quick), and every read checks
the payloads it serves (read_check.py); the scrub finds the damage no read has met yet, and
quarantines it as a read would (quarantine.py, through the store's `quarantine`: a rollout with a
piece lost or damaged, or whose head no longer decodes, has its pieces dropped,
partial_holds.drop_damaged), so the next sample, or the rollout's last piece, does not have to. It
never holds the writer: it reads in read transactions of at most CHUNK_BYTES or CHUNK_ITEMS (short,
so the file's old pages are not held either), sleeps between them so that it reads at most
`mb_per_second` (payloads and their records, and pieces; the counts it reports are of payload and
piece bytes, those a table's `bytes` and `partial_bytes` count), and quarantines what it finds in
a short write transaction of its own. The map pages it read are given back every RELEASE_BYTES
(residency.py), so RSS does not grow with the file. The last complete pass is kept in the directory
(`meta` database, key `scrub`), so a restart still says when the data was last checked whole.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import lmdb

from expbuf.client.trxp.stored.pieces import Stored

from ..core.table_state.counters import read_counters
from ..core.whole_table import reading
from ..disk import chunk_reads, layout, piece_rows, residency
from ..disk.environment import Environment
from ..schema.errors import DamagedPiece
from ..tables.catalog import TableCatalog

log = logging.getLogger("expbuf.store")
CHUNK_BYTES = 1 << 20
CHUNK_ITEMS = 1024
RELEASE_BYTES = 64 << 20
LAST_PASS = b"scrub"  # in the meta database: the last complete pass, as JSON


@dataclass(frozen=True)
class ScrubStatus:
    """What the scrub has done: its settings, the pass under way (or the last one), the totals
    since the store opened, and the last complete pass (kept across restarts)."""

    mb_per_second: float = 0.0  # the bound; 0: no background scrub
    interval_seconds: float = 0.0
    running: bool = False
    pass_checked_bytes: int = 0  # payload bytes (and pieces'), as every byte count here
    pass_total_bytes: int = 0  # the live payload bytes and pieces' stored when the pass started
    passes: int = 0  # complete passes since the store opened
    checked_bytes: int = 0  # since the store opened
    checked: int = 0  # experiences, since the store opened
    found: int = 0  # experiences quarantined, and rollouts held in pieces dropped, by the scrub since the store opened
    last_pass_end_unix: float = 0.0  # 0: never
    last_pass_seconds: float = 0.0
    last_pass_bytes: int = 0
    last_pass_found: int = 0


Quarantine = Callable[[str, list[str]], int]  # (table, uids) -> how many were quarantined


class Scrub:
    """The scrub of one store's payloads, run by a thread of its own (`start`) or a pass at a
    time (`run_pass`)."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        quarantine: Quarantine,
        *,
        mb_per_second: float = 0.0,
        interval_seconds: float = 86400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.environment, self.catalog, self.quarantine, self.clock = environment, catalog, quarantine, clock
        self.mb_per_second, self.interval_seconds = mb_per_second, interval_seconds
        self._lock = threading.Lock()
        self._status = ScrubStatus(mb_per_second=mb_per_second, interval_seconds=interval_seconds)
        self._status = self._with_last_pass(self._status)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._released = 0  # bytes read since the map's pages were last given back
        self._reported: set[str] = set()

    # ---- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Scrub in the background, a pass now and one every interval_seconds (if the rate is above 0)."""
        if self.mb_per_second > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="expbuf-scrub", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the pass under way at its next chunk, and the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run_pass()
            except Exception:  # a failure of one pass (a full disk at its record, say) is not the last
                log.exception("scrub pass failed; the next starts in %gs", self.interval_seconds)
            self._stop.wait(max(0.0, started + self.interval_seconds - time.monotonic()))

    # ---- a pass --------------------------------------------------------------------------

    def status(self) -> ScrubStatus:
        """What the scrub has done so far (a consistent copy)."""
        with self._lock:
            return self._status

    def _running(self, running: bool, total: int = 0) -> None:
        """A pass begins (its counts from zero, `total` bytes to check) or ends (its counts kept)."""
        with self._lock:
            s = self._status
            self._status = replace(
                s,
                running=running,
                pass_checked_bytes=0 if running else s.pass_checked_bytes,
                pass_total_bytes=total if running else s.pass_total_bytes,
            )

    def run_pass(self) -> int:
        """Check every stored payload and piece once, at the rate bound (none when it is 0),
        quarantining the damaged (a rollout held in pieces: dropped); returns how many were. A stop
        ends it early, not counted as a pass."""
        rate = self.mb_per_second * 1e6
        tables = self.catalog.entries()
        with self.environment.read() as txn:
            counted = [read_counters(txn, self.db, layout.table_prefix(t)) for t, _ in tables]
        total = sum(counters.bytes + counters.partial_bytes for counters in counted)
        began, started = self.clock(), time.monotonic()
        self._running(True, total)
        checked_bytes = found = 0
        try:
            for table_id, config in tables:
                prefix = layout.table_prefix(table_id)
                group_by = config.grouping.by if config.storage.layout == "rows" else None
                after: bytes | None = prefix
                while after is not None and not self._stop.is_set():
                    chunk_started = time.monotonic()
                    bad, after, payloads, nbytes, count = self._chunk(prefix, after, group_by)
                    newly = self._found(table_id, bad)
                    found += newly
                    checked_bytes += payloads
                    self._counted(payloads, nbytes, count, newly)
                    if rate > 0:
                        self._stop.wait(max(0.0, nbytes / rate - (time.monotonic() - chunk_started)))
                held = self._held(prefix)
                at: tuple[int, int] | None = (0, 0)
                while at is not None and not self._stop.is_set():
                    chunk_started = time.monotonic()
                    bad, at, nbytes = self._pieces_chunk(prefix, held, at)
                    newly = self._found(table_id, bad)
                    found += newly
                    checked_bytes += nbytes
                    self._counted(nbytes, nbytes, 0, newly)
                    if rate > 0:
                        self._stop.wait(max(0.0, nbytes / rate - (time.monotonic() - chunk_started)))
            if self._stop.is_set():
                return found
            self._finish(began, time.monotonic() - started, checked_bytes, found)
            return found
        finally:
            self._running(False)
            residency.release(self.environment.path / "data.mdb")
            self._released = 0

    @property
    def db(self) -> dict[str, lmdb._Database]:
        return self.environment.db

    def _counted(self, payloads: int, nbytes: int, count: int, found: int) -> None:
        """A chunk done: its payload bytes and experiences counted, the map's pages given back
        every RELEASE_BYTES read."""
        with self._lock:
            s = self._status
            self._status = replace(
                s,
                pass_checked_bytes=s.pass_checked_bytes + payloads,
                checked_bytes=s.checked_bytes + payloads,
                checked=s.checked + count,
                found=s.found + found,
            )
        self._released += nbytes
        if self._released >= RELEASE_BYTES:
            residency.release(self.environment.path / "data.mdb")
            self._released = 0

    def _chunk(
        self, prefix: bytes, after: bytes, group_by: str | None
    ) -> tuple[list[str], bytes | None, int, int, int]:
        """Check the payloads from key `after` on, up to CHUNK_BYTES or CHUNK_ITEMS, in one read
        transaction: the uids found damaged, where the next chunk starts (None: the table's
        end), the payload bytes checked, the bytes read (payloads and records) and the payloads
        checked. A rows table's (`group_by`: its grouping) are checked against its members' rows."""
        bad: list[str] = []
        payloads = nbytes = count = 0
        db = self.db
        try:
            with self.environment.read(buffers=True) as txn, reading.payload_cursor(txn, db) as cur:
                rows = None if group_by is None else reading.RowMembers(txn, db, prefix, group_by)
                found = cur.set_range(after)
                while found and cur.key()[:4] == prefix:
                    if nbytes >= CHUNK_BYTES or count >= CHUNK_ITEMS:
                        return bad, bytes(cur.key()), payloads, nbytes, count
                    key, read = cur.key(), chunk_reads.reader(txn, db)
                    streamed = chunk_reads.streamed(cur.value(), key, read)  # held a chunk at a time
                    blob = chunk_reads.resolve(cur.value(), key, read) if streamed is None else streamed
                    length = len(blob) if streamed is None else streamed[1]
                    payloads += length
                    count += 1
                    uid = bytes(key[4:]).decode()
                    if rows is not None:
                        nbytes += length
                        damaged = self._row_damaged(uid, rows, blob)
                    else:
                        raw = reading.record_raw(txn, db, bytes(key))
                        nbytes += length + (0 if raw is None else len(raw))
                        damaged = raw is not None and self._damaged(key, raw, blob)
                    if damaged:
                        bad.append(uid)
                    found = cur.next()
        except lmdb.Error as exc:  # a page LMDB cannot read: `expbuf check` says more; the next table goes on
            self._report(f"table {layout.table_of(prefix)}: reading its payloads raised {type(exc).__name__}: {exc}")
        return bad, None, payloads, nbytes, count

    def _found(self, table_id: int, bad: list[str]) -> int:
        """Those of `bad` found damaged again in the writer quarantined, or dropped where they are
        rollouts held in pieces (Store.quarantine); how many were. A table dropped meanwhile has none."""
        table = self.catalog.by_id(table_id)
        return self.quarantine(table[0], bad) if bad and table is not None else 0

    def _held(self, prefix: bytes) -> list[str]:
        """The uids of the table's rollouts held in pieces as the pass reaches them."""
        try:
            with self.environment.read() as txn:
                return [uid for uid, _ in piece_rows.heads_under(txn, self.db, prefix, prefix)]
        except lmdb.Error as exc:
            table = layout.table_of(prefix)
            self._report(f"table {table}: reading its rollouts held in pieces raised {type(exc).__name__}: {exc}")
            return []

    def _pieces_chunk(
        self, prefix: bytes, held: list[str], at: tuple[int, int]
    ) -> tuple[list[str], tuple[int, int] | None, int]:
        """Check the pieces of the rollouts `held` from `at` on (a rollout's index there, a piece's
        number) against the sizes and digests their heads took at their pushes, up to CHUNK_BYTES or
        CHUNK_ITEMS pieces, in one read transaction (each head read again in it: a rollout finished
        since is not there, one grown since has its new pieces checked): the uids found with a piece
        lost or damaged (or their head undecodable), where the next chunk starts (None: the end), and
        the bytes read."""
        bad: list[str] = []
        nbytes = count = 0
        index, number = at
        db = self.db
        try:
            with self.environment.read(buffers=True) as txn:
                while index < len(held):
                    uid = held[index]
                    key = piece_rows.head_key(prefix, uid)
                    try:
                        head = piece_rows.head(txn, db, key, uid)
                    except DamagedPiece:  # its head no longer decodes: dropped as a read drops it
                        bad.append(uid)
                        head = None
                    while head is not None and number < len(head.pieces):
                        if nbytes >= CHUNK_BYTES or count >= CHUNK_ITEMS:
                            return bad, (index, number), nbytes
                        raw = piece_rows.piece(txn, db, key, number)
                        nbytes, count = nbytes + (0 if raw is None else len(raw)), count + 1
                        if raw is None or piece_rows.problem(head, number, raw) is not None:
                            bad.append(uid)
                            break
                        number += 1
                    index, number = index + 1, 0
        except lmdb.Error as exc:
            self._report(f"table {layout.table_of(prefix)}: reading its pieces raised {type(exc).__name__}: {exc}")
        return bad, None, nbytes

    def _damaged(self, key: memoryview, raw: bytes | memoryview, blob: Stored | tuple[bytes, int]) -> bool:
        """Whether the payload (or its digest and length, chunk_reads.streamed) is not the one its
        record's digest names."""
        try:
            return reading.payload_mismatch(bytes(key[4:]).decode(), raw, blob)
        except Exception as exc:  # a record a damaged page made undecodable: structure, for `expbuf check`
            self._report(f"the record of {bytes(key[4:])[:80]!r} does not decode ({type(exc).__name__}: {exc})")
            return False

    def _row_damaged(self, uid: str, rows: reading.RowMembers, blob: Stored | tuple[bytes, int]) -> bool:
        """Whether a rows table's payload is not the one its member's row names; a segment, state row or
        directory entry a damaged page made undecodable is structure, for `expbuf check`, as a records
        table's record is (`_damaged`): the pass goes on to the payloads after it."""
        try:
            row = rows.of(uid)
        except Exception as exc:
            self._report(f"the row of {uid[:80]!r} does not decode ({type(exc).__name__}: {exc})")
            return False
        return row is not None and reading.row_payload_mismatch(uid, row, blob)

    def _report(self, problem: str) -> None:
        if problem not in self._reported:
            self._reported.add(problem)
            log.error("scrub: %s; run `expbuf check` on a copy of the data directory", problem)

    # ---- the last complete pass ---------------------------------------------------------------

    def _finish(self, began: float, seconds: float, nbytes: int, found: int) -> None:
        record = {"end": self.clock(), "began": began, "seconds": seconds, "bytes": nbytes, "found": found}
        meta = self.db["meta"]
        self.environment.submit(lambda txn: txn.put(LAST_PASS, json.dumps(record).encode(), db=meta))
        with self._lock:
            self._status = self._with_last_pass(replace(self._status, passes=self._status.passes + 1))
        log.log(
            logging.WARNING if found else logging.DEBUG,  # a clean pass is in the metrics and `expbuf stats`
            "scrub pass done: %.0f MB checked in %.0f s (%.1f MB/s), %d damaged experience(s) or rollout(s) found",
            nbytes / 1e6, seconds, nbytes / 1e6 / max(seconds, 1e-9), found,
        )  # fmt: skip

    def _with_last_pass(self, status: ScrubStatus) -> ScrubStatus:
        """The status with the last complete pass as the directory keeps it."""
        with self.environment.read() as txn:
            raw = txn.get(LAST_PASS, db=self.db["meta"])
        try:
            record = json.loads(raw) if raw is not None else None
            if not isinstance(record, dict):
                return status
            return replace(
                status,
                last_pass_end_unix=float(record["end"]),
                last_pass_seconds=float(record["seconds"]),
                last_pass_bytes=int(record["bytes"]),
                last_pass_found=int(record["found"]),
            )
        except (ValueError, KeyError, TypeError):
            return status
