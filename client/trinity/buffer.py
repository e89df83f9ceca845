"""Trinity-RFT's BufferWriter and BufferReader over an expbuf table.

The explorer's experience pipeline writes through ExpbufWriter; the trainer's sample
strategy reads through ExpbufReader. Both take the StorageConfig Trinity-RFT builds from
its `buffer.trainer_input.experience_buffer` section, whose `path` is `expbuf://HOST:PORT/TABLE`.
Trinity's interface is asyncio; the blocking client runs in a worker thread, so either works
from whichever event loop Trinity calls it on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import grpc
from trinity.buffer.buffer_reader import BufferReader
from trinity.buffer.buffer_writer import BufferWriter
from trinity.common.config import StorageConfig
from trinity.common.experience import Experience

from expbuf.client.client import BufferClient, BufferError, PushResult

from .location import Location, parse

log = logging.getLogger(__name__)
GROUP_KEY_OF = {"task": "tid", "run": "rid", "step": "sid", "none": "uid"}


def _client(location: Location) -> BufferClient:
    return BufferClient(location.target, token=location.token, tls=location.tls)


@dataclass
class _Writers:
    """What the writers of one table in this process share: Trinity's reference count and
    the groups they pushed that are not complete yet."""

    refs: int = 0
    pending: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_WRITERS: dict[tuple[str, str], _Writers] = {}
_WRITERS_LOCK = threading.Lock()


def _writers(location: Location) -> _Writers:
    with _WRITERS_LOCK:
        return _WRITERS.setdefault((location.target, location.table), _Writers())


class ExpbufWriter(BufferWriter):
    """Pushes each write durably into the table; the last writer's release seals its open groups.

    `acquire`/`release` count the writers of one table in this process, as Trinity's own
    storages do. When the count drops to zero, groups these writers left incomplete are
    sealed (completed now, advantages computed over the runs that arrived) if the table
    releases incomplete groups (`on_group_timeout = "release"`, with a `group_size`); a table
    that drops them (`"drop"`) is left to its group timeout. Reading the table's settings
    needs the `sample` scope; a push-only token writes normally and seals nothing.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.location = parse(config.path)
        self._client = _client(self.location)
        self._group_key: str | None = None
        self._seals = False
        self._settings_read = False

    def _read_settings(self) -> None:
        """Learn how the table groups and whether it wants incomplete groups released."""
        self._settings_read = True
        try:
            tables = {t["name"]: t for t in self._client.list_tables()}
        except BufferError as exc:
            log.warning("expbuf: cannot read table settings (%s); incomplete groups will not be sealed", exc)
            return
        settings = tables.get(self.location.table)
        if settings is None:
            return
        self._group_key = GROUP_KEY_OF[settings["group_by"]]
        self._seals = settings["group_size"] > 0 and settings["on_group_timeout"] == "release"

    def _push(self, data: list[Experience]) -> PushResult:
        if not self._settings_read:
            self._read_settings()
        result = self._client.push(Experience.serialize_many(data), self.location.table)
        if self._seals and self._group_key:
            shared = _writers(self.location)
            with shared.lock:
                shared.pending.update(getattr(exp.eid, self._group_key) for exp in data)
                shared.pending.difference_update(result.completed_groups)
        return result

    async def write(self, data: list[Experience]) -> None:
        """Store the experiences; returns once the server has committed them to disk."""
        if data:
            await asyncio.to_thread(self._push, list(data))

    async def acquire(self) -> int:
        shared = _writers(self.location)
        with shared.lock:
            shared.refs += 1
            return shared.refs

    async def release(self) -> int:
        shared = _writers(self.location)
        with shared.lock:
            shared.refs = max(0, shared.refs - 1)
            refs = shared.refs
            pending, shared.pending = (shared.pending, set()) if refs == 0 else (set(), shared.pending)
        if pending:
            await asyncio.to_thread(self._seal, sorted(pending))
        self._client.close()
        return refs

    def _seal(self, groups: list[str]) -> None:
        for group in groups:
            try:
                self._client.seal(group, self.location.table)
            except BufferError as exc:
                # Completed by another writer's push, or timed out meanwhile: nothing left to seal.
                if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise


class ExpbufReader(BufferReader):
    """Reads batches of whole groups under a lease, and acknowledges each on the next read.

    A batch is acknowledged only once the trainer asks for the next one, i.e. after the
    training step that used it; if the trainer dies first, the lease expires and the batch
    goes back to the buffer. `state_dict()` holds the open lease: a trainer restarted from a
    checkpoint acknowledges it on its first read, since that batch is in the checkpoint.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.location = parse(config.path)
        self.batch_size = config.batch_size
        self.timeout = config.max_read_timeout
        self._client = _client(self.location)
        self._lease = ""
        self._experiences_read = 0
        self._batches_read = 0

    async def read(self, batch_size: int | None = None, **kwargs: Any) -> list[Experience]:
        """The next `batch_size` experiences (whole groups: the last may end past it), with advantages.

        `min_model_version` (Trinity's staleness-control sample strategy) keeps only groups
        whose every experience is at least that fresh. `model_version`, the policy version the
        trainer holds (the `expbuf` sample strategy gives it), is the table's trainer version:
        the server measures staleness, screens pushes and admits rollouts against it. No batch
        within Trinity's `max_read_timeout` is a TimeoutError, as with Trinity's own queue.
        """
        unknown = set(kwargs) - {"min_model_version", "model_version"}
        if unknown:
            raise TypeError(f"ExpbufReader.read() got unexpected argument(s): {', '.join(sorted(unknown))}")
        size = self.batch_size if batch_size is None else batch_size
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"batch_size must be a positive number of experiences, got {size!r}")
        min_version = kwargs.get("min_model_version")
        min_version = int(min_version) if min_version is not None and min_version > 0 else None
        version = kwargs.get("model_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"model_version must be a non-negative integer, got {str(version)[:40]!r}")
        return await asyncio.to_thread(self._read, size, min_version, version)

    def _read(self, size: int, min_version: int | None, version: int | None = None) -> list[Experience]:
        self._acknowledge()
        stream = self._client.sample(
            self.location.table,
            batch_size=size,
            order=self.location.order,
            delivery="lease",
            lease_seconds=self.location.lease_seconds,
            timeout=self.timeout,
            max_batches=1,
            min_model_version=min_version,
            trainer_version=version,
        )
        try:
            with closing(stream):
                batch = next(stream)
        except BufferError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(
                    f"expbuf table '{self.location.table}': no {size} experiences of whole groups "
                    f"within {self.timeout} s (max_read_timeout)"
                ) from exc
            raise
        experiences = Experience.deserialize_many(batch.payload)
        self._lease = batch.lease_id
        self._batches_read += 1
        self._experiences_read += len(experiences)
        return experiences

    def _acknowledge(self) -> None:
        """Acknowledge the batch handed out last: the training step that used it is over."""
        lease, self._lease = self._lease, ""
        if not lease:
            return
        try:
            self._client.ack(lease, table=self.location.table)
        except BufferError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                self._lease = lease
                raise
            log.warning("expbuf: lease %s expired or was already settled; its batch may be read again", lease)

    def state_dict(self) -> dict[str, Any]:
        return {
            "current_index": self._experiences_read,
            "batches_read": self._batches_read,
            "lease_id": self._lease,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the counts and take over the open lease, to acknowledge it on the next read."""
        self._experiences_read = int(state_dict.get("current_index", 0))
        self._batches_read = int(state_dict.get("batches_read", 0))
        self._lease = str(state_dict.get("lease_id") or "")
