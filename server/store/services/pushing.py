"""Pushes: validated entries stored in the writer's transaction, durably when it returns.

A push in chunks stages its large sections before its push is stored (`stage`, chunked.py), and
drops them should it be refused (`drop_staged`); what it stages is bounded by its table's
capacity_bytes, from the size it announces (`staged`, staged.py).

A push alone is a sequence of one: `put_in_order` stores a stream's pushes in order, as many
as it holds in one request to the writer, each in a transaction nested in it (so a refusal
undoes only its own push), and stops at the first that does not store. Those that stored
share the writer's commit; the caller hears each one's result once durable, and a refused
push's refusal after them, with none after it stored: exactly as if each had been sent after
the reply of the one before.

A full table in block mode, or a rate limit that holds a push, is waited out until the
pushes' timeout, the push tried again (with those after it) at each change of the environment.
The caller may say whether they may wait at all (`may_wait`, asked before they first would): the
server lets a push wait only where a call that waits idle would be let in (server/rpc/interceptors/limits.py), and
refuses it at once otherwise.
Where the server gives a table a computation (`in_push`: one-value estimators), the groups the
push completes get their advantages in its transaction, computed before it where the push's
groups can be foreseen (pushed_advantages.py). The server hears of each push that stored
something, once it is durable (`on_stored`: its advantage worker starts at the first that needs
it); a push that stores nothing (held by a rate limit or a full table to its deadline, say) is
not heard of.

A last piece of a large rollout held in pieces has its rollout put together off the writer when
the writer asks for it (partials.OffWriter: services/assembly.py), and its push tried again; a
rollout may take `max_push_bytes` at most (the largest push: the server's). A last piece whose
rollout holds a piece lost or damaged on disk (or a head that no longer decodes: any piece's
push) is refused (DamagedPiece), nothing of its push kept, once the rollout's pieces are dropped
in a write of their own, as a read quarantines what it finds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import lmdb

from ..core.ordering.ready import IndexBuilding
from ..core.table_state.state import TableState
from ..disk import chunk_heads, chunked, layout, zstd_workers
from ..disk.environment import Environment
from ..disk.kinds import Ahead, Compute, Entry, MayWait, Push, PutResult
from ..rules import capacity, limiter, partials, pushed_advantages, pushes
from ..schema.errors import Cancelled, Conflict, DamagedPiece, InsertLimited, NotFound, TableFull
from ..schema.table_config import TableConfig
from ..tables import admission
from ..tables.catalog import TableCatalog
from . import assembly, joined_pushes
from .index_builds import IndexBuilds
from .staged import StagedPushes

SET_BLOCK = 1024  # chunk set numbers reserved at a time
TOGETHER_TRIES = 4  # a rollout put together off the writer whose pieces changed meanwhile, again
# A table's state in the writer's transaction, by table id and configuration (Store._state_in).
StateIn = Callable[["lmdb.Transaction[bytes]", int, TableConfig], TableState]


def _any_piece(entries: Sequence[Entry]) -> bool:
    """Whether any of a push's entries is a piece of a partial rollout: their pieces read in C."""
    return [entry.piece for entry in entries].count(None) != len(entries)


@dataclass(frozen=True, slots=True)
class Ready:
    """One push, looked up and with its advantages computed ahead, ready for the writer (which
    reads its entries from the push itself: see kinds.Push)."""

    push: Push
    table_id: int
    config: TableConfig
    ahead: Ahead | None


class Pushing:
    """Pushes into a data directory's tables; `state_in` opens a table's state in the writer's
    transaction (Store._state_in)."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        state_in: StateIn,
        builds: IndexBuilds,
        quarantine: Callable[[str, list[str]], int],
        max_push_bytes: int = 16 << 30,
    ) -> None:
        self.environment, self.catalog, self._state_in, self.builds = environment, catalog, state_in, builds
        self.quarantine = quarantine  # Store.quarantine: a rollout whose piece is found damaged dropped
        self.in_push: Callable[[TableConfig], Compute | None] | None = None
        self.on_stored: Callable[[TableConfig], None] | None = None
        self.max_push_bytes = max_push_bytes  # the largest push; a rollout in pieces takes no more (the server's)
        self._sets_lock = threading.Lock()
        self._sets = (0, 0)  # the chunk set numbers reserved and not handed out yet: [first, end)
        self.staged = StagedPushes(environment, catalog)

    def put(
        self,
        table: str,
        entries: Sequence[Entry],
        *,
        timeout: float | None = None,
        holder: str = "",
        may_wait: MayWait | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> PutResult:
        """Store validated entries durably. A full table in block mode, or a rate limit that holds
        the push, waits until timeout, or until `stop()` says its call ended (Cancelled)."""
        (result,) = self.put_in_order([Push(table, entries, holder)], timeout=timeout, may_wait=may_wait, stop=stop)
        return result

    def put_in_order(
        self,
        pushes: Sequence[Push],
        *,
        timeout: float | None = None,
        may_wait: MayWait | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[PutResult]:
        """Store pushes durably, in order, each as `put` would; yields each one's result once it is
        durable. A refused push raises after the results of those before it, and none after it is
        stored. They share one deadline, `timeout` from now. Before they first wait for room,
        `may_wait()` is asked: a reason it gives refuses the push that would wait, with it. A push
        that waits for room looks at `stop()` (whether its call has ended) every STOP_POLL_SECONDS,
        and ends Cancelled once it says so, giving back what its call holds."""
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else 0.0)
        todo: deque[Ready] = deque()
        unready: Exception | None = None  # a push that cannot be tried (its table does not exist)
        for push in pushes:
            try:
                todo.append(self._ready(push))
            except Exception as exc:
                unready = exc
                break
        since, held = start, False  # when the first push of `todo` was first tried; whether a rate limit held it
        staged: dict[str, list[int]] = {}  # by table: the sets of the rollouts put together off the writer
        try:
            yield from self._in_turn(todo, since, held, deadline, may_wait, staged, stop)
        finally:
            for table, sets in staged.items():
                self.drop_staged(table, sets)  # those of the pushes that did not store them
        if unready is not None:
            raise unready

    def _in_turn(
        self,
        todo: deque[Ready],
        since: float,
        held: bool,
        deadline: float,
        may_wait: MayWait | None,
        staged: dict[str, list[int]],
        gone: Callable[[], bool] | None,
    ) -> Iterator[PutResult]:
        """put_in_order's turns at the writer, each taking the pushes of `todo` that store (`gone`:
        put_in_order's `stop`)."""
        together = 0  # the rollouts put together off the writer for the first push of `todo`
        while todo:
            generation = self.environment.generation
            now = time.monotonic()
            final = now >= deadline
            done, stop = self._submit(list(todo), final, now - since if held else 0.0)
            for result in done:
                ready = todo.popleft()
                if self.on_stored is not None and (result.stored or result.partial):
                    self.on_stored(ready.config)
                yield result
            if done:
                since, held, together = time.monotonic(), False, 0
            if stop is None:
                continue
            if isinstance(stop, IndexBuilding):  # nothing was kept: tried again once the index is built
                self.builds.wait(stop)
                continue
            if isinstance(stop, partials.OffWriter):  # nothing was kept: tried again with the rollout put together
                together += 1
                if together > TOGETHER_TRIES + len(todo[0].push.entries):
                    raise Conflict(
                        f"rollout {stop.uid}'s pieces changed each time its last piece's rollout was put together; "
                        "push the last piece again"
                    )
                try:
                    self._together(todo[0], stop.uid, staged)
                except DamagedPiece as exc:
                    raise self._dropped(todo[0], exc) from None
                continue
            if isinstance(stop, DamagedPiece):
                raise self._dropped(todo[0], stop)
            if isinstance(stop, TableFull):
                if todo[0].config.capacity.when_full != "block" or final:
                    raise stop
            elif isinstance(stop, InsertLimited):
                if final:
                    raise stop
                held = True
            else:
                raise stop
            if may_wait is not None:
                refused = may_wait()
                if refused is not None:
                    raise type(stop)(f"{stop}; the push may not wait: {refused}")
                may_wait = None
            if gone is not None and gone():
                table = todo[0].push.table
                raise Cancelled(f"a push to table '{table}' ended while it waited for room; nothing of it was stored")
            self.environment.wait_for_change(generation, deadline, poll=gone is not None)

    def _dropped(self, ready: Ready, damaged: DamagedPiece) -> DamagedPiece:
        """The refusal of a push that met a damaged piece (nothing of it kept), once the rollout's
        pieces are dropped, checked again in the writer (Store.quarantine): its worker may push it
        again from its first piece."""
        self.quarantine(ready.push.table, [damaged.uid])
        return damaged

    def _together(self, ready: Ready, uid: str, staged: dict[str, list[int]]) -> None:
        """Put together off the writer the rollout that the last piece of `uid` in a push finishes
        (assembly.put_together), the push's entry made the experience it makes; where its rollout
        is not as planned, the piece is left as pushed, for the writer to say what it finds."""
        entries = list(ready.push.entries)
        at = next(n for n, e in enumerate(entries) if e.uid == uid and e.piece is not None and not e.piece[1])
        together = entries[at].together
        last = entries[at] if together is None else together.piece
        earlier = [e for e in entries[:at] if e.uid == uid]
        made = assembly.put_together(self, ready.push.table, ready.table_id, last, earlier)
        if made is None:
            entries[at] = last
        else:
            entries[at] = made[0]
            staged.setdefault(ready.push.table, []).append(made[1])
        ready.push.entries = entries

    def new_chunk_set(self) -> int:
        """A chunk set number for a section a push in chunks stages, never used before: taken
        from a block of them reserved in one write (chunked.reserve_sets)."""
        with self._sets_lock:
            if self._sets[0] == self._sets[1]:
                dbs = self.environment.db
                first = self.environment.submit(lambda txn: chunked.reserve_sets(txn, dbs, SET_BLOCK))
                self._sets = (first, first + SET_BLOCK)
            set_id = self._sets[0]
            self._sets = (set_id + 1, self._sets[1])
            return set_id

    def zstd_level(self, table: str) -> int | None:
        """The zstd level `table` compresses the chunks of large sections at; None where it keeps
        them as they are (its setting `compression`)."""
        return self.catalog.lookup(table)[1].storage.zstd_level

    def stage(
        self, table: str, set_id: int, index: int, chunk: bytes | memoryview, level: int | None = None
    ) -> Future[None]:
        """Write chunk `index` of a section a push in chunks stages, in set `set_id`
        (chunked.stage), in the writer's next commit, shared with the requests waiting then as a
        push's is: the future is done once it is durable. Chunks are written in the order staged;
        with a `level`, each as a zstd frame, compressed here, before the writer."""
        table_id = self.catalog.lookup(table)[0]
        dbs, now = self.environment.db, self.catalog.clock()
        stored = chunk if level is None else zstd_workers.compress(chunk, level)

        def write(txn: lmdb.Transaction[bytes]) -> None:
            if self.catalog.stored_id(txn, table) != table_id:  # nothing left under a dropped table's id
                raise NotFound(f"table '{table}' was dropped (and made again) while the push was read; push it again")
            chunked.stage(txn, dbs, layout.table_prefix(table_id), set_id, index, stored, now)

        return self.environment.queue(write, grows=True)

    def drop_staged(self, table: str, set_ids: Sequence[int]) -> None:
        """Those of the sets a push in chunks staged that are staged still go (chunked.drop_set): a
        refused push's, a duplicate's; its stored experiences' sets are theirs, no longer staged."""
        if not set_ids or not self.catalog.has(table):  # a dropped table's staged sets went with it
            return
        prefix = layout.table_prefix(self.catalog.lookup(table)[0])
        dbs = self.environment.db

        def staged(txn: lmdb.Transaction[bytes]) -> list[int]:
            return [s for s in set_ids if txn.get(chunk_heads.set_prefix(prefix, s), db=dbs["staged"]) is not None]

        with self.environment.read() as txn:
            if not staged(txn):  # a stored push's: nothing to write
                return

        def drop(txn: lmdb.Transaction[bytes]) -> None:
            for set_id in staged(txn):
                chunked.drop_set(txn, dbs, prefix, set_id)

        self.environment.submit(drop)

    def _ready(self, push: Push) -> Ready:
        """A push looked up, with the advantages it is expected to compute, computed now; in a
        table that compresses, its large sections' chunks compressed now, off the writer."""
        table_id, config = self.catalog.lookup(push.table)
        level = config.storage.zstd_level
        if level is not None:
            self._compress(push, level)
        compute = self.in_push(config) if self.in_push is not None else None
        if _any_piece(push.entries):
            compute = None  # the rollouts its pieces finish are put together in the writer, not foreseen here
        ahead = pushed_advantages.compute_ahead(config, push.entries, compute) if compute is not None else None
        return Ready(push, table_id, config, ahead)

    def _compress(self, push: Push, level: int) -> None:
        """Replace each entry whose section is over MIN_COMPRESSED with its head and zstd frames
        (chunked.compressed: all the push's chunks compressed side by side), pieces of partial
        rollouts aside (the store puts their rollouts together in the writer). A list of entries
        is updated in place, so the caller's references to the payloads as they were are let go."""
        entries = push.entries if isinstance(push.entries, list) else list(push.entries)
        blobs = [None if entry.piece is not None else entry.blob for entry in entries]
        for at, made in enumerate(chunked.compressed(blobs, level, self.new_chunk_set)):
            if made is not None:
                entries[at] = dataclasses.replace(entries[at], blob=made[0], chunks=tuple(made[1]))
        push.entries = entries

    def _submit(self, pushes: list[Ready], final: bool, blocked: float) -> tuple[list[PutResult], Exception | None]:
        """`in_order` in the writer's next transaction (a small push stored with those of other callers
        side by side: joined_pushes.py); the first push's refusal, or the failure of the whole
        transaction, as what stopped it."""
        pieces = len(pushes) == 1 and _any_piece(pushes[0].push.entries)
        key = joined_pushes.joins(pushes, blocked, pieces)
        request = joined_pushes.PushRequest(self, pushes, final, blocked, key)
        try:
            return self.environment.submit(
                request, together=None if key is None else joined_pushes.together, grows=True
            )
        except Exception as exc:
            return [], exc

    def in_order(
        self, txn: lmdb.Transaction[bytes], pushes: list[Ready], final: bool, blocked: float
    ) -> tuple[list[PutResult], Exception | None]:
        """In the writer's transaction: the pushes in order, each in a transaction nested in `txn`
        (none for a push alone), until one does not store; the results of those that stored, and
        what stopped the next (its refusal, or the rate limit that holds it), which the ones after
        it wait for. A refusal of the first push is raised, so that nothing of it is kept."""
        done: list[PutResult] = []
        for ready in pushes:
            child = self.environment.nested(txn) if len(pushes) > 1 else txn
            try:
                # looked up again: a push that waited may find its table dropped (or dropped and made again)
                table_id, config = self.catalog.lookup(ready.push.table)
                ahead = ready.ahead if table_id == ready.table_id else None
                tt = self._state_in(child, table_id, config)
                blocked_for = blocked if not done else 0.0
                push = ready.push
                result = self._put(
                    tt, push.entries, push.holder, final, blocked_for, self.in_push, ahead, self.max_push_bytes
                )
            except Exception as exc:
                if child is not txn:
                    child.abort()
                if not done or isinstance(exc, lmdb.MapFullError):  # a full map: the writer grows it and runs all again
                    raise
                return done, exc
            if child is not txn:
                child.commit()
            if isinstance(result, InsertLimited):  # kept: at the deadline it counts the time it held the push
                return done, result
            done.append(result)
        return done, None

    def put_joined(
        self,
        txn: lmdb.Transaction[bytes],
        ready: Ready,
        entries: Sequence[Entry],
        alike: Callable[[TableState], bool],
        largest: int,
    ) -> PutResult | None:
        """The entries of small pushes into `ready`'s table by its holder stored as one push
        (joined_pushes.py), in `txn`; None where its table changed since they were looked up, where
        `alike` says that the table as it is would not take them as it takes the pushes one after the
        other, where a rate limit holds them, or would hold any of them (the `largest` of them) once
        the groups the others complete count, or where it leaves to the advantage worker groups whose
        advantages it computes in a push (more than a push computes, or a group whose values fail
        failing the others'): the caller undoes `txn` then."""
        table_id, config = self.catalog.lookup(ready.push.table)
        if table_id != ready.table_id:
            return None
        tt = self._state_in(txn, table_id, config)
        if not alike(tt):
            return None
        computing = tt.counters.groups_computing
        result = self._put(tt, entries, ready.push.holder, False, 0.0, self.in_push, None, self.max_push_bytes)
        if isinstance(result, InsertLimited) or not limiter.inserts_fit(tt, largest):
            return None
        computes = self.in_push is not None and self.in_push(config) is not None
        return None if computes and tt.counters.groups_computing > computing else result

    @staticmethod
    def _put(
        tt: TableState,
        entries: Sequence[Entry],
        holder: str,
        final: bool,
        blocked: float,
        in_push: Callable[[TableConfig], Compute | None] | None,
        ahead: Ahead | None,
        most: int,
    ) -> PutResult | InsertLimited:
        """Store entries, or the rate limit that holds them (with the time it held them,
        counted when it lets them go or at the deadline). With `in_push`, the groups the push
        completes get their advantages in its transaction where it gives the table a computation
        (`ahead`: computed before it, for the groups the push was expected to complete). A rollout
        in pieces takes `most` bytes at most (partials.take). `holder` is who pushes (kinds.Push)."""
        has_pieces = _any_piece(entries)
        # the pieces of partial rollouts are not inserts: the rollouts they finish are
        held = limiter.insert_limit(
            tt, [e for e in entries if e.piece is None or not e.piece[1]] if has_pieces else entries
        )
        if blocked and (held is None or final):
            tt.counters.insert_blocked_seconds += blocked
            tt.save()
        if held is not None:
            return held

        def room(size: int, opened: int) -> None:
            capacity.make_room(tt, 0, size, set(), opened)

        pieces = (  # with none, a rollout pushed whole still replaces the pieces held of it
            partials.take(tt, entries, room, most, holder) if has_pieces or tt.counters.partials else None
        )
        kept, stale = admission.screen(tt, entries if pieces is None else pieces.entries)
        compute = in_push(tt.config) if in_push is not None else None
        result = pushes.put(tt, kept, holder=holder, compute=compute, ahead=ahead)
        result.stale = stale
        if pieces is not None and stale:
            partials.dropped_stale(tt, stale)
        if pieces is not None:
            answered = {*result.stored, *result.duplicates, *result.stale}
            partials.joinable(tt, pieces.stored, answered, {*result.completed_groups, *result.dropped_groups})
            result.partial, result.duplicates = pieces.stored, [*pieces.duplicates, *result.duplicates]
        return result
