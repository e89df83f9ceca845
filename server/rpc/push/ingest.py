"""Decoding and packing pushed payloads, in this process or in a pool of processes; and
staging the large items of a push in chunks as it arrives (`Stager`).

Validation and packing are Python work per experience, so under the GIL they use one
core however many pushers there are. With `ingest_processes` > 0 (cores - 1 by default) they run
in that many worker processes (fresh interpreters that import the codec alone:
ingest_worker.py; no thread of the server is forked) while other pushes are being decoded:
the server process keeps the storage and the RPCs. A push that arrives while no other is
being decoded is decoded here, where it costs no hand-off: a single pusher is as fast as with no
processes; so is a payload below SMALL, whose decode is shorter than the hand-off, and one above
LARGE, whose cost is copying, which the hand-off would double. Every check is the same code either way.
The processes start at the first push a worker would take, in the background (that push and those
beside it are decoded here meanwhile): a server that never decodes two such pushes at once starts none.

A payload goes to a worker and its packed experiences come back through shared memory
(one memfd per worker), the experiences' fields as one pickle of tuples: no per-item
pickling and no payload-sized pipe transfers. A worker that dies is reaped and replaced within
WATCH_SECONDS (a thread watches the idle ones), and the push it was decoding is decoded here instead.

A stop signal sent to the server's whole process group (a terminal's Ctrl-C, GNU `timeout`,
systemd's default `KillMode=control-group`, `kill -TERM -PGID`) reaches the workers too: they
ignore SIGINT and SIGTERM from birth, finish the pushes they are decoding, and end when the
server closes the pool, as it does when it stops (or when its interpreter exits).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize

from expbuf.client import trxp
from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.stream import NotStreamable, Piece, StreamedPayload
from expbuf.client.trxp.column_batch import wire as column_wire

from ...config import ServerConfig
from ...store import CHUNK_BYTES, Entry, StagedShare, Staging, Store
from ...store.schema.errors import InvalidPayload
from . import ingest_worker
from .ingest_worker import entries_of, metadata_limit

log = logging.getLogger("expbuf.ingest")

STAGING = 2  # chunks of a push in chunks waiting for the writer at once
# Payloads larger than this are decoded here: their cost is copying bytes, which a worker would
# add to (the payload into the region, the experiences out of it), not Python work per experience.
LARGE = 16 << 20
# Payloads smaller than this are decoded here too: their decode is shorter than the hand-off
# (8 pushers of 8 x 8 KB experiences pushed 0.84x with one worker what they did with none).
SMALL = 256 << 10
WATCH_SECONDS = 0.5  # how often the watch of idle workers looks again at the pool
RETRY_SECONDS = 60  # after the workers failed to start, how long before a push asks again
# How long a worker may take to answer a push: these, and one more for each MiB of it (a worker's
# decode takes milliseconds a MiB). One that takes longer is stopped, frozen or stuck (a cgroup's
# freezer, a debugger, swapped out): it is killed and replaced and the push decoded here. Waited for
# without a bound, it held its push, and every push after it waited for a worker to come free, for
# good, the server's health SERVING and its stop unable to end.
ANSWER_SECONDS = 10.0
# How long a push waits for a worker to come free before it is decoded here.
WORKER_WAIT_SECONDS = 1.0


def _shared_fd() -> int:
    """An anonymous shared file: a memfd (not bounded by /dev/shm), else an unlinked temporary file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("expbuf-ingest", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as file:
        return os.dup(file.fileno())


class _Worker:
    """One ingest process (ingest_worker.py), the connection it takes requests on and its shared
    region."""

    def __init__(self, max_metadata_bytes: int) -> None:
        ours, theirs = socket.socketpair()
        self.region = ingest_worker.Region(_shared_fd())
        command = [sys.executable, "-m", ingest_worker.__name__, str(theirs.fileno()), str(self.region.fd)]
        command.append(str(max_metadata_bytes))
        # It imports what this process can (its sys.path, as multiprocessing's spawn gives a child):
        # expbuf may be on it only as a Ray runtime environment or a script put it there.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        # Blocked in this thread only while the process starts: one sent meanwhile reaches the
        # server once unblocked (or another of its threads at once).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ingest_worker.STOP_SIGNALS)
        try:
            self.process = subprocess.Popen(command, pass_fds=(theirs.fileno(), self.region.fd), env=env)
        except BaseException:
            ours.close()
            self.region.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        self.conn = Connection(ours.detach())
        self.same = False  # whether it makes entries as the server does: known once ready()
        self.closed = False  # ended: a place in the pool kept for a worker that could not start

    def ready(self) -> None:
        """Wait until the process has imported everything (started now, not at the first push), and
        learn whether it makes entries as the server does. The server puts each entry together
        from the worker's fields by their place; a worker started from other code (expbuf upgraded
        in place under a running server) may place them otherwise, and would put one field's
        value in another's: such a worker decodes nothing, the server decodes its pushes itself."""
        fields = pickle.loads(self.conn.recv_bytes())
        self.same = fields == ingest_worker.FIELDS
        if not self.same:
            log.warning(
                "an ingest process makes entries of fields %s, the server of %s: its code is not the server's "
                "(expbuf changed on disk under a running server?); the server decodes pushes itself until it restarts",
                fields,
                ingest_worker.FIELDS,
            )

    def entries(self, payload: bytes | memoryview) -> list[Entry] | Exception | None:
        """The payload's entries decoded by this worker, or its refusal; None if the refusal
        must be found here (as for any push, where the worker's code is not the server's). A
        dead worker raises EOFError or OSError."""
        if not self.same:
            return None
        region = self.region
        region.fit(len(payload))[: len(payload)] = payload
        self.conn.send_bytes(ingest_worker.REQUEST.pack(len(payload), region.size))
        bound = ANSWER_SECONDS + len(payload) / (1 << 20)
        if not self.conn.poll(bound):
            raise TimeoutError(f"the ingest process {self.process.pid} did not answer a push within {bound:.0f} s")
        raw = self.conn.recv_bytes()
        try:
            reply, size = pickle.loads(raw)
        except Exception:  # a refusal that does not unpickle
            return None
        view = region.fit(size)
        try:
            if not isinstance(reply, list):
                return reply
            entries, pos, blob, placed = [], 0, ingest_worker.BLOB, Entry.placed
            for row in reply:
                end = pos + row[blob]
                entries.append(placed(row, view[pos:end]))  # a slice of the map: the blob's one copy here
                pos = end
            return entries
        finally:
            region.release()

    def close(self) -> None:
        self.closed = True
        self.conn.close()  # the process ends when its connection does
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.region.close()


class Ingest:
    """Turns pushed payloads into entries, here or in `processes` worker processes (0: always here),
    each experience's metadata within `max_metadata_bytes`. The processes start (in the background)
    at the first push that another's decode overlaps and a worker would take (`entries`), or at
    `start()`: a server whose pushes are decoded here alone (a lone pusher, small or large payloads)
    never starts them, and no push waits for them to start."""

    def __init__(self, processes: int = 0, max_metadata_bytes: int = ServerConfig.max_metadata_bytes) -> None:
        self.processes = processes
        self.max_metadata_bytes = max_metadata_bytes
        self._limit = metadata_limit(max_metadata_bytes)
        self._free = threading.Condition()  # guards the fields below; notified when a worker is free
        self._decoding = 0  # pushes being decoded, here or in a worker
        self._closed = False
        self._asked = False  # the workers are started, or being started
        self._retry_at = 0.0  # after a failed start, when a push may ask again
        self._workers: list[_Worker] = []  # every worker, once all are ready
        self._idle: list[_Worker] = []  # every worker, until pushes take them
        # A pool no one closed is closed as the interpreter exits: its workers end (their
        # connections closed) and are reaped, rather than outlive it for a moment.
        self._at_exit = Finalize(None, self.close, exitpriority=0)

    def start(self) -> None:
        """Start the worker processes and wait until each is ready (a failure ends those started
        and raises); nothing if they are started, or being started, already."""
        with self._free:
            if self._asked or self._closed or not self.processes:
                return
            self._asked = True
        workers: list[_Worker] = []
        try:
            for _ in range(self.processes):
                workers.append(_Worker(self.max_metadata_bytes))
            for worker in workers:
                worker.ready()
        except BaseException:  # those started end now, not with an interpreter that may keep this pool
            for worker in workers:
                worker.close()
            with self._free:
                self._asked = False
                self._retry_at = time.monotonic() + RETRY_SECONDS
            raise
        with self._free:
            closed = self._closed
            if not closed:
                self._workers, self._idle = list(workers), list(workers)
                self._free.notify_all()
        if closed:  # closed while they started: no push needs them
            for worker in workers:
                worker.close()
            return
        threading.Thread(target=self._watch, name="expbuf-ingest-watch", daemon=True).start()

    def _start_in_background(self) -> None:
        try:
            self.start()
        except Exception:
            log.exception(
                "cannot start the ingest processes; pushes are decoded in the server's process, "
                "and a push tries again in %d s",
                RETRY_SECONDS,
            )

    def _watch(self) -> None:
        """Replace an idle worker that died (reaping it) within WATCH_SECONDS, not at the next push
        that would reach it. A worker that dies while decoding is replaced by that push."""
        while True:
            with self._free:
                if self._closing():
                    return
                dead = [worker for worker in self._idle if not worker.closed and worker.process.poll() is not None]
                for worker in dead:
                    self._idle.remove(worker)
            for worker in dead:
                log.warning("an ingest process died (exit code %s); starting a new one", worker.process.returncode)
                self._give_back(self._replacement(worker))
                if self._closing():
                    return
            time.sleep(WATCH_SECONDS)

    def _closing(self) -> bool:
        """Closed, or the interpreter is exiting (its main thread has ended, and the pool is closed
        at exit): no new worker is started then."""
        return self._closed or not threading.main_thread().is_alive()

    def entries(self, payload: bytes | memoryview) -> list[Entry]:
        if not self.processes or not SMALL <= len(payload) <= LARGE:
            return entries_of(payload, self._limit)
        with self._free:
            alone = self._decoding == 0
            self._decoding += 1
            ready = bool(self._workers)
            ask = not alone and not self._asked and not self._closed and time.monotonic() >= self._retry_at
        if ask:  # the first push a worker would take: they start while it is decoded here
            threading.Thread(target=self._start_in_background, name="expbuf-ingest-start", daemon=True).start()
        try:
            return self._in_worker(payload) if ready and not alone else entries_of(payload, self._limit)
        finally:
            with self._free:
                self._decoding -= 1

    def _in_worker(self, payload: bytes | memoryview) -> list[Entry]:
        with self._free:
            free = self._free.wait_for(lambda: self._idle or self._closed, timeout=WORKER_WAIT_SECONDS)
            if self._closed or not free:  # none came free: decoded here, not held behind a stuck worker
                return entries_of(payload, self._limit)
            worker = self._idle.pop()
        returned: _Worker | None = worker
        if worker.closed:  # a place whose worker could not start: one is started again, or it is decoded here
            self._give_back(self._replacement(worker))
            return entries_of(payload, self._limit)
        try:
            result = worker.entries(payload)
        except Exception:  # died, killed mid-reply, or stuck: its connection can no longer be trusted
            log.warning("an ingest process failed; starting a new one, and decoding this push here", exc_info=True)
            returned = self._replacement(worker)
            result = None
        finally:
            self._give_back(returned)
        if isinstance(result, Exception):
            raise result
        return entries_of(payload, self._limit) if result is None else result

    def _replacement(self, broken: _Worker) -> _Worker | None:
        """What takes a broken worker's place in the pool: a new worker (none once the pool is
        closed); or, where none can start now (no file descriptors, no memory for a process), the
        broken one itself, closed: a push that takes it decodes here, and one RETRY_SECONDS later
        starts a worker again. Its place is never left empty: a push waits for an idle worker
        while the pool holds any (`_in_worker`), and would wait for good."""
        broken.close()
        with self._free:
            if self._closed:
                return None
            if time.monotonic() < self._retry_at:
                return broken
        worker = None
        try:
            worker = _Worker(self.max_metadata_bytes)
            worker.ready()
        except Exception:
            if worker is not None:  # it ends now, not with the interpreter
                worker.close()
            log.exception("cannot start an ingest process; a push tries again in %d s", RETRY_SECONDS)
            with self._free:
                self._retry_at = time.monotonic() + RETRY_SECONDS
            return broken
        with self._free:
            self._workers[self._workers.index(broken)] = worker
        return worker

    def _give_back(self, worker: _Worker | None) -> None:
        with self._free:
            if worker is not None and not self._closed:
                self._idle.append(worker)
                self._free.notify()
                return
        if worker is not None:  # the pool was closed while it decoded
            worker.close()

    def close(self) -> None:
        """End the worker processes, those decoding a push too (the server's stop closes the pool
        once its grace is past): killed, their pushes are decoded here, or refused by a closed
        store. One left stuck held its push's thread, and the stop's exit waited for it for good."""
        self._at_exit.cancel()
        with self._free:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [worker for worker in self._workers if worker not in idle and not worker.closed]
            self._free.notify_all()
        for worker in idle:
            worker.close()
        for worker in busy:
            worker.process.kill()  # its push's wait for it ends (EOFError): the push is decoded here


class Stager:
    """Pushes in chunks whose large items are stored as they arrive: each large item's tensor
    data is staged in the store piece by piece (Store.stage, store/disk/chunked.py) while its
    push is read, so that the server holds a piece of each (client/trxp/stream.py), not the push.
    The push's items are checked from its head before any of its data is read."""

    def __init__(self, store: Store, max_metadata_bytes: int) -> None:
        self.store, self._limit = store, metadata_limit(max_metadata_bytes)

    def open(self, table: str, start: memoryview, size: int) -> StagedPush | None:
        """The push of `size` bytes into `table` that starts with `start`, to be staged as it
        arrives; None if it is read whole: it has no large item, its head is not whole in
        `start`, its head is refused (the whole payload's parse then says why), or it carries
        pieces of partial rollouts, which the store puts together from whole pieces."""
        try:
            if column_wire.is_columns(start):
                head = column_wire.head(start, size, CHUNK_BYTES, self._limit)
                if head is None:
                    return None
                payload = StreamedPayload(start, size, CHUNK_BYTES, head=head)
            else:
                payload = StreamedPayload(start, size, CHUNK_BYTES, limit=self._limit)
        except (NotStreamable, trxp.TrxpError):
            return None
        if any(partial.mark_of(item.meta) is not None for item in payload.items):
            return None
        return StagedPush(self.store, table, payload)


class StagedPush:
    """One push in chunks being staged: `open` its share of its table's staging, `feed` it its
    bytes after the head, then take its `entries`; `drop` the staging its push did not store,
    however it ended. Up to STAGING chunks of it wait for the writer at once, so that the
    writer's commits take several and the push is read on meanwhile."""

    def __init__(self, store: Store, table: str, payload: StreamedPayload) -> None:
        self.store, self.table, self.payload = store, table, payload
        self._staging = {
            index: Staging(payload.heads[index], payload.section_lengths[index]) for index in payload.large
        }
        self._writing: collections.deque[Future[None]] = collections.deque()
        self._share: StagedShare | None = None

    @property
    def stages(self) -> int:
        """The bytes it writes to disk before its commit: its large items' payloads, as its head says."""
        return sum(staging.size for staging in self._staging.values())

    def open(self, timeout: float) -> None:
        """Take its share of its table's staging before anything is staged: refused (a StoreError)
        where what it stages does not fit in the table's capacity_bytes within `timeout`."""
        self._share = self.store.open_staged(self.table, self.stages, timeout)

    @property
    def holds(self) -> int:
        """The most of the push the server holds at once: StreamedPayload.holds (a piece of each
        large item being filled among the rest), the chunks waiting for the writer, and the one
        `feed` holds while it waits for room among them."""
        return self.payload.holds + (STAGING + 1) * CHUNK_BYTES

    def feed(self, data: memoryview) -> None:
        """The push's next bytes, fed a store's chunk at a time, the pieces each fills staged before
        the next is read: a client's chunk of any size (up to a message) holds no more pieces at
        once than `holds` counts, where fed whole it filled all of its pieces first (a chunk of 96
        MiB: 92 MiB of them held beside it, uncounted in max_inflight_bytes)."""
        for at in range(0, len(data), CHUNK_BYTES):
            try:
                pieces = self.payload.feed(data[at : at + CHUNK_BYTES])
            except trxp.TrxpError as exc:  # a token-level reward its head could not show (stream.py)
                raise InvalidPayload(str(exc)) from None
            self._stage(pieces)

    def _stage(self, pieces: list[Piece]) -> None:
        for item, number, data in pieces:
            staging = self._staging[item]
            if staging.set_id is None:
                staging.set_id, staging.level = self.store.new_chunk_set(), self.store.zstd_level(self.table)
            while len(self._writing) >= STAGING:
                self._writing.popleft().result()
            writing = self.store.stage(self.table, staging.set_id, number, data, staging.level)
            writing.add_done_callback(self._counted(len(data)))
            self._writing.append(writing)
            staging.add(data)

    def _counted(self, nbytes: int) -> Callable[[Future[None]], None]:
        """What counts a chunk's bytes in its table's staged bytes once its commit is done."""
        share = self._share

        def counted(writing: Future[None]) -> None:
            if share is not None and writing.exception() is None:
                share.add(nbytes)

        return counted

    def _written(self) -> None:
        """Wait for every chunk staged to be durable (a refusal of the store's raised)."""
        while self._writing:
            self._writing.popleft().result()

    def entries(self) -> list[Entry]:
        """The push's experiences as the store takes them, once all its bytes were fed and
        their chunks are durable."""
        self._stage(self.payload.finish())
        self._written()
        made = []
        for index, item in enumerate(self.payload.items):
            staging = self._staging.get(index)
            if staging is None:
                made.append(Entry.of(item))
            else:
                generated = self.payload.generated[index]
                made.append(Entry.staged(item, staging.head(), staging.digest(), staging.size, generated))
        return made

    def drop(self) -> None:
        """Drop what this push staged and its push did not store (a refused push's, a duplicate's),
        once the chunks still on their way to the writer are written (or refused)."""
        for writing in self._writing:
            writing.exception()
        self._writing.clear()
        try:
            self.store.drop_staged(self.table, [s.set_id for s in self._staging.values() if s.set_id is not None])
        finally:
            if self._share is not None:
                self._share.close()
