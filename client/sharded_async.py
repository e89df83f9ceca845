"""AsyncShardedBufferClient: the asyncio twin of ShardedBufferClient (sharded.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc

from .client import (
    AsyncBufferClient,
    Batch,
    BufferError,
    Grant,
    PushResult,
)
from .experience import Experience
from .shard_common import ShardBatch, ShardError, _merge_push, _merge_stats, _shard_error, _Sharded, allocate

# How long sample() waits between looks at the shards' ready counts when none can fill a batch.
_POLL_SECONDS = (0.02, 0.5)
# A ready-count probe of one shard: no retries, a short deadline; a shard that fails it is skipped.
_PROBE_SECONDS = 2.0
_MIN_FIELDS = {"min_model_version"}
_MAX_FIELDS = {"max_model_version", "oldest_age_seconds"}


class AsyncShardedBufferClient(_Sharded):
    """asyncio twin of ShardedBufferClient, with the methods of AsyncBufferClient."""

    _client_class = AsyncBufferClient

    async def close(self) -> None:
        clients = (*self.clients.values(), *self._probes.values(), *self._retired)
        await asyncio.gather(*(client.close() for client in clients))

    async def __aenter__(self) -> AsyncShardedBufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _each(self, call: Callable[[str, AsyncBufferClient], Any], shards: Iterable[str] | None = None) -> dict:
        names = list(self.clients if shards is None else shards)
        outcomes = await asyncio.gather(*(call(n, self.clients[n]) for n in names), return_exceptions=True)
        results = {n: r for n, r in zip(names, outcomes, strict=True) if not isinstance(r, BaseException)}
        errors = {n: r for n, r in zip(names, outcomes, strict=True) if isinstance(r, BaseException)}
        for error in errors.values():
            if not isinstance(error, BufferError):
                raise error
        if errors:
            raise _shard_error(errors, self.shard_map.targets, results)
        return results

    async def _table_group_by(self, table: str) -> str:
        if table not in self._group_by:
            await self.list_tables()
        return self._known_group_by(table)

    async def push(
        self, items: bytes | Iterable[Any], table: str = "default", *, timeout: float | None = None
    ) -> PushResult:
        parts = self._split(items, await self._table_group_by(table))
        try:
            results = await self._each(lambda shard, c: c.push(parts[shard], table, timeout=timeout), parts)
        except ShardError as exc:
            exc.result = _merge_push(exc.result.values())
            raise
        return _merge_push(results.values())

    async def _ready(self, table: str, key: str) -> dict[str, int]:
        names = list(self._probes)
        outcomes = await asyncio.gather(*(self._probes[n].stats(table) for n in names), return_exceptions=True)
        return {
            n: r[table][key]
            for n, r in zip(names, outcomes, strict=True)
            if not isinstance(r, BaseException) and table in r
        }

    async def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        order: str = "fifo",
        delivery: str = "consume",
        lease_seconds: float = 60.0,
        timeout: float = 30.0,
        max_batches: int = 0,
        min_model_version: int | None = None,
        allow_partial: bool = False,
        trainer_version: int | None = None,
    ) -> AsyncIterator[ShardBatch]:
        """As ShardedBufferClient.sample; leased batches' ack()/nack() return coroutines."""
        key, need = self._need(batch_size, num_groups)
        request = {"order": order, "delivery": delivery, "lease_seconds": lease_seconds}
        request |= {"min_model_version": min_model_version, "timeout": 0.0, "max_batches": 1}
        request |= {"trainer_version": trainer_version}
        if trainer_version is not None:  # every shard, the admission shard too, whether or not it holds data
            await self.set_trainer_version(trainer_version, table)
        sent = 0
        while not max_batches or sent < max_batches:
            deadline, pause, parts, got = time.monotonic() + timeout, _POLL_SECONDS[0], [], 0
            while True:
                ready, late = await self._ready(table, key), time.monotonic() >= deadline
                want = allocate(ready, need - got)
                if sum(want.values()) >= need - got or (late and want):
                    parts += await self._fetch(table, key, want, request | {"allow_partial": late})
                    got = sum(self._size(key, part) for _, part in parts)
                if got >= need or late:
                    break
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, _POLL_SECONDS[1])
            if not parts:
                self._nothing(ready, allow_partial, need, key, timeout)
                return
            sent += 1
            yield self._merge(parts, got < need, self.ack, self.nack)
            if got < need:
                return

    async def _fetch(self, table: str, key: str, want: Mapping[str, int], request: dict) -> list[tuple[str, Batch]]:
        async def one(shard: str, count: int) -> list[Batch]:
            size = {"num_groups": count} if key == "groups_ready" else {"batch_size": count}
            return [batch async for batch in self.clients[shard].sample(table, **size, **request)]

        names = list(want)
        outcomes = await asyncio.gather(*(one(n, want[n]) for n in names), return_exceptions=True)
        parts = []
        for shard, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, BufferError):
                continue  # taken by another trainer meanwhile, filtered out, or the shard went down
            if isinstance(outcome, BaseException):
                raise outcome
            parts += [(shard, batch) for batch in outcome]
        return parts

    async def ack(self, lease_id: str, table: str = "default") -> int:
        return await self._end(lease_id, lambda client, lease: client.ack(lease, table))

    async def nack(self, lease_id: str, table: str = "default") -> int:
        return await self._end(lease_id, lambda client, lease: client.nack(lease, table))

    async def _end(self, lease_id: str, call: Callable[[AsyncBufferClient, str], Awaitable[int]]) -> int:
        done, errors = 0, {}
        for shard, lease in self._leases(lease_id):
            try:
                done += await call(self.clients[shard], lease)
            except BufferError as exc:
                errors[shard] = exc
        if errors:
            raise _shard_error(errors, self.shard_map.targets, done)
        return done

    async def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell every shard's table the trainer's current policy version."""
        return min((await self._each(lambda _, c: c.set_trainer_version(version, table))).values())

    async def reset_offpolicy(
        self, table: str = "default", trainer_version: int | None = None
    ) -> dict[str, dict[str, int]]:
        """As BufferClient.reset_offpolicy, on every shard; each shard's answer by its name."""
        return await self._each(lambda _, c: c.reset_offpolicy(table, trainer_version))

    async def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """As BufferClient.admit, on the table's admission shard (`admission_shard`)."""
        client = self.clients[self.admission_shard(table)]
        return await client.admit(table, count, wait=wait, grant_seconds=grant_seconds)

    async def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant on the shard that granted it."""
        return await self.clients[self.admission_shard(grant.table)].finish_grant(grant, accepted)

    async def get(self, uids: Iterable[str], table: str = "default") -> list[Experience]:
        uids = list(uids)
        parts = await self._each(lambda _, c: c.get(uids, table))
        found = {exp.eid.uid: exp for part in parts.values() for exp in part}
        return [found[uid] for uid in uids if uid in found]

    async def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        uids, groups = list(uids), list(groups)
        return sum((await self._each(lambda _, c: c.delete(uids, table, groups=groups))).values())

    async def seal(self, group_id: str, table: str = "default") -> int:
        return await self.clients[self.shard_map.owner(group_id)].seal(group_id, table)

    async def stats(self, table: str = "") -> dict[str, dict[str, Any]]:
        return _merge_stats((await self.shard_stats(table)).values())

    async def shard_stats(self, table: str = "") -> dict[str, dict[str, dict[str, Any]]]:
        return await self._each(lambda _, c: c.stats(table))

    async def server_info(self) -> dict[str, dict[str, Any]]:
        return await self._each(lambda _, c: c.server_info())

    async def create_table(self, name: str, *, exist_ok: bool = False, **settings: Any) -> dict[str, Any]:
        configs = await self._each(lambda _, c: c.create_table(name, exist_ok=exist_ok, **settings))
        config = next(iter(configs.values()))
        self._group_by[name] = config.get("group_by") or "task"
        return config

    async def list_tables(self) -> list[dict[str, Any]]:
        for client in self.clients.values():
            try:
                tables = await client.list_tables()
            except BufferError:
                continue
            return self._remember(tables)
        raise ShardError(grpc.StatusCode.UNAVAILABLE, "no shard answered", list(self.clients))

    async def drop_table(self, name: str) -> int:
        self._group_by.pop(name, None)
        return sum((await self._each(lambda _, c: c.drop_table(name))).values())
