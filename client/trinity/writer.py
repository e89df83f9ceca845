"""Trinity-RFT's BufferWriter over an expbuf table: the explorer's experience pipeline writes
through ExpbufWriter, durably, each write's groups complete when it ends. Experiences of a task read
from an expbuf dataset (taskset.py) are written under their prompt's EID, so that they make the
prompt's group. Trinity's interface is asyncio; the blocking client runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import uuid

import grpc
from trinity.buffer.buffer_writer import BufferWriter
from trinity.common.config import StorageConfig
from trinity.common.experience import Experience

from expbuf.client.client import BufferClient, BufferError, PushResult
from expbuf.client.kit.location import connect, parse
from expbuf.client.kit.retry import Retry, retried
from expbuf.client.schema.experience import ordered_id
from expbuf.client.schema.reasons import Reason
from expbuf.client.schema.routing import GROUP_KEY_OF

from . import settings
from .taskset import prompt_eid

log = logging.getLogger("expbuf.client.trinity.buffer")  # the name users' logging configs know (buffer.py)


def _stale_attempt(exc: BufferError) -> bool:
    """Whether a push was refused for holding the group of a prompt attempt whose claim ended."""
    return exc.reason == Reason.STALE_ATTEMPT


def _prompt_groups(data: list[Experience]) -> list[Experience]:
    """Experiences of a task read from an expbuf dataset get its prompt's EID batch and task (from
    the task's index, which Trinity copies into `info["task_index"]`), in place of the explore
    step and the task's place in it that Trinity's workflow runner gave them."""
    out = []
    for exp in data:
        prompt = prompt_eid(exp.info)
        if prompt is not None and (str(exp.eid.batch), str(exp.eid.task)) != prompt:
            exp = copy.copy(exp)
            exp.eid = dataclasses.replace(exp.eid, batch=prompt[0], task=prompt[1])
        out.append(exp)
    return out


def _distinct_groups(data: list[Experience]) -> list[Experience]:
    """Experiences written without an eid (no batch, no task) each get a group of their own, instead
    of all sharing the group '/': a new `ordered_id` as their task, set on their own eid as they are
    written, so that the same objects written again (a retried write) are the same uids, stored once.
    Their suffix (Trinity-RFT's: 6 random hex digits) was their task before, which two of some
    thousands shared: the write of the second was refused as a conflict with the first."""
    for exp in data:
        eid = exp.eid
        if str(eid.batch) == "" and str(eid.task) == "":
            eid.task = ordered_id()
    return data


def _prioritised(exp: Experience) -> Experience:
    """Trinity's priority queue ranks by `model_version` (less a decay per use; unread: none):
    the table's `priority` order reads `info["priority"]`, stamped here where not set."""
    info = exp.info or {}
    if "priority" in info or not isinstance(info.get("model_version"), (int, float)):
        return exp
    exp = copy.copy(exp)
    exp.info = {**info, "priority": float(info["model_version"])}
    return exp


class ExpbufWriter(BufferWriter):
    """Pushes each write durably into the table; the groups of a write are complete when it ends.

    Trinity's explorer writes each step's experiences in one write, every run of a task
    together (after its pipeline's operators), so the groups a write leaves incomplete (runs
    a filter dropped, runs that failed) get no more runs: the writer seals them when the write
    is stored (`on_group_timeout = "release"` tables; a `"drop"` table is left to its
    timeout). `acquire`/`release` open and close a writer of the table on the server, whose
    count ends the trainer's reads when the last writer, in whichever process, closes.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.location = parse(config.path)
        settings.refuse_taskset(config)
        settings.refuse_dataset(self.location, config.name)
        self._client = connect(self.location)  # closed by the release of its last acquire; `_open` opens it again
        self._priorities = settings.priority_replay(config) is not None
        self._table = settings.table_settings(self._client, self.location)
        settings.check_capacity(config, self._table)
        table = self._table
        self._group_key = GROUP_KEY_OF[table.group_by if table else "task"]
        self._seals = bool(table and table.group_size > 0 and table.on_group_timeout == "release")
        self._ids: list[str] = []  # each acquire's writer id, not yet released

    def _push(self, data: list[Experience]) -> PushResult:
        data = _distinct_groups(_prompt_groups(data))
        if self._priorities:
            data = [_prioritised(exp) for exp in data]
        try:
            result = self._store(data)
        except BufferError as exc:
            if not _stale_attempt(exc):
                raise
            result = self._store_each_group(data)
        if result.duplicates:
            log.warning(
                "expbuf: %d of %d experiences written to table '%s' were stored already (first: %s); "
                "stored once, as a retried write is",
                len(result.duplicates), len(data), self.location.table, result.duplicates[0],
            )  # fmt: skip
        if self._seals:
            open_groups = {getattr(exp.eid, self._group_key) for exp in data}
            self._seal(sorted(open_groups - set(result.completed_groups)))
        return result

    def _store_each_group(self, data: list[Experience]) -> PushResult:
        """A write that held the group of a prompt attempt whose claim had ended (the task outlasted
        its claim) was refused whole: its groups go one at a time, and those of ended attempts are
        left out, their prompts having gone out again with their next attempt."""
        groups: dict[str, list[Experience]] = {}
        for exp in data:
            groups.setdefault(getattr(exp.eid, self._group_key), []).append(exp)
        stored, duplicates, completed, stale = [], [], [], []
        for members in groups.values():
            try:
                part = self._store(members)
            except BufferError as exc:
                if not _stale_attempt(exc):
                    raise
                table = self.location.table
                log.warning("expbuf: table '%s': %d experiences not written: %s", table, len(members), exc.details)
                continue
            stored += part.stored
            duplicates += part.duplicates
            completed += part.completed_groups
            stale += part.stale
        return PushResult(stored, duplicates, completed, stale)

    def _store(self, data: list[Experience]) -> PushResult:
        payload = Experience.serialize_many(data)
        full = Retry()  # no bound: a full table blocks the writer, as Trinity's queue does
        while True:
            try:  # a server that restarts is waited for (the eids are the objects' own: stored once)
                result = retried(lambda: self._client.push(payload, self.location.table), self._client.timeout)
                break
            except BufferError as exc:
                if exc.reason == Reason.TABLE_FULL:
                    # A table that evicts refuses at once when it has nothing to evict (every group
                    # pending or leased), as does a server with no thread left to wait in: pause
                    # between tries, or the payload goes again in a tight loop until the trainer acks.
                    log.info("expbuf: table '%s' is full; the write waits for room", self.location.table)
                    time.sleep(full.pause() or 0.0)
                    continue
                if exc.reason == Reason.GROUP_OVERFILLED:
                    raise ValueError(self._overfill(exc.details)) from exc
                if exc.reason == Reason.GROUP_CLOSED:
                    raise ValueError(
                        f"expbuf table '{self.location.table}': {exc.details}: a group's experiences came in "
                        "two writes, and a write completes its groups when it is stored (sealed, or group_size 0); "
                        "write every run of a task together, as Trinity's explorer does"
                    ) from exc
                raise
        return result

    def _overfill(self, details: str) -> str:
        size = self._table.group_size if self._table else "its"
        return (
            f"expbuf table '{self.location.table}': {details}. group_size counts experiences ({size}), and a "
            "multi-step workflow writes several per run: create the table with group_size = 0, so that each "
            "write's groups complete when it is stored"
        )

    async def write(self, data: list[Experience]) -> None:
        """Store the experiences; returns once the server has committed them to disk."""
        if data:
            self._open()
            await asyncio.to_thread(self._push, list(data))

    def _open(self) -> BufferClient:
        """The writer's client: closed by the release of its last acquire, opened again for a
        writer used after it (a write, an acquire, a release again), where its calls failed with
        gRPC's ValueError of a closed channel."""
        if self._client.closed:
            self._client = connect(self.location)
        return self._client

    async def acquire(self) -> int:
        """Open a writer of the table on the server, where the trainer's reads see it; returns the
        table's open writers, in every process (Trinity's reference count)."""
        writer_id = uuid.uuid4().hex  # its open and close counted once, and against this table alone
        opened, _ = await asyncio.to_thread(self._open().writers, self.location.table, 1, writer_id)
        self._ids.append(writer_id)
        return opened

    async def release(self) -> int:
        """Close a writer; when the table's last writer closes, its readers reach the end of data.
        A release with no writer open (one without an acquire) ends it too, as Trinity's storages
        end their readers when their count of writers reaches zero or below."""
        writer_id = self._ids.pop() if self._ids else ""
        still_open = await asyncio.to_thread(self._close, writer_id)
        if not self._ids:
            self._client.close()
        return still_open

    def _close(self, writer_id: str) -> int:
        """The server's close of a writer (`writer_id`, its acquire's; empty for a release without
        one); one with none open changes nothing there, so a release without an acquire ends the
        table as its last writer ends it: opened and closed. Not a writer that acquired: the
        server forgot its count (a restart: it keeps it in memory), or the table was dropped and
        made again since (its close counts against the table it opened alone), and
        ending the table would end the trainer's reads while other explorers still write; the
        readers end by max_read_timeout instead (docs/frameworks/trinity.md)."""
        table, client = self.location.table, self._open()
        acquired = bool(writer_id)
        still_open, done = client.writers(table, -1, writer_id)
        if still_open == 0 and not done and acquired:
            log.warning(
                "expbuf table %r: the server counts no writer open at this writer's release (it restarted since"
                " the acquire?): the table is not ended here; its readers end by max_read_timeout",
                table,
            )
        elif still_open == 0 and not done:
            once = uuid.uuid4().hex
            client.writers(table, 1, once)
            still_open, _ = client.writers(table, -1, once)
        return still_open

    def _seal(self, groups: list[str]) -> None:
        for group in groups:
            try:
                self._client.seal(group, self.location.table)
            except BufferError as exc:
                # Completed by another writer's push, or timed out meanwhile: nothing left to seal.
                if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise
