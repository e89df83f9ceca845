"""AsyncShardedBufferClient: the asyncio twin of ShardedBufferClient (blocking.py).

It runs the same plans (plans.py), making the calls each step asks for at once with
asyncio.gather.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any, Unpack

from ..aio import AsyncBufferClient
from ..errors import BufferError
from ..results import BufferStats, FailedRuns, Grant, PushResult, ServerInfo, TableInfo
from ..rpc import calls
from ..rpc.api import Calls
from ..rpc.declare import AwaitingShards, Turns
from ..rpc.sample_spec import SampleOptions, SampleSpec
from ..schema.table_presets import with_preset
from ..schema.table_settings import TableSettings
from .common import AsyncShardBatch, LiveResult, ShardBatch
from .plans import Call, Emit, Plan, T
from .poll import Wait
from .pusher import AsyncShardedPusher
from .routes import ShardPlans


class AsyncShardedBufferClient(ShardPlans, AwaitingShards, Calls):
    """asyncio twin of ShardedBufferClient, with the methods of AsyncBufferClient."""

    _client_class = AsyncBufferClient

    async def close(self) -> None:
        """Close every shard's channel."""
        clients = (*self.clients.values(), *self._probes.values(), *self._retired)
        await asyncio.gather(*(client.close() for client in clients))

    async def __aenter__(self) -> AsyncShardedBufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- the driver --------------------------------------------------------------------------

    async def _call(self, call: Call) -> Any:
        client = (self._probes if call.quick else self.clients)[call.shard]
        try:
            if call.method == "sample":
                return [batch async for batch in client.sample(*call.args, **call.kwargs)]
            return await getattr(client, call.method)(*call.args, **call.kwargs)
        except BufferError as exc:
            return exc

    async def _step(self, step: Any) -> Any:
        if isinstance(step, Wait):
            await asyncio.sleep(step.seconds)
            return None
        return await asyncio.gather(*(self._call(call) for call in step))

    async def _run(self, plan: Plan[T]) -> T:
        turns = Turns(plan)
        for step in turns:
            turns.answer(await self._step(step))
        return turns.result

    # ---- AsyncBufferClient's methods ---------------------------------------------------------

    async def push(self, items: calls.Items, table: str = "default", *, timeout: float | None = None) -> PushResult:
        """As ShardedBufferClient.push."""
        return await self._run(self._push(items, table, timeout))

    def pusher(self, table: str = "default", *, window: int = 4, timeout: float | None = None) -> AsyncShardedPusher:
        """Pipelined pushes to `table` over the shards, as ShardedBufferClient.pusher: `await
        pusher.push(items)` returns an asyncio Future of the PushResult. See AsyncShardedPusher."""
        return AsyncShardedPusher(self, table, window, timeout, lambda: self._run(self._group_by_of(table)))

    async def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        **options: Unpack[SampleOptions],
    ) -> AsyncIterator[ShardBatch]:
        """As ShardedBufferClient.sample; leased batches' ack()/nack() return coroutines."""
        spec = SampleSpec(table, batch_size, num_groups, **options)
        for step in (turns := Turns(self._sample(spec, self, AsyncShardBatch))):
            if isinstance(step, Emit):
                yield step.batch
            else:
                turns.answer(await self._step(step))

    async def ack(self, lease_id: str, table: str = "default") -> int:
        """As ShardedBufferClient.ack."""
        return await self._run(self._end(lease_id, "ack", table))

    async def nack(self, lease_id: str, table: str = "default") -> int:
        """As ShardedBufferClient.nack."""
        return await self._run(self._end(lease_id, "nack", table))

    async def renew(self, lease_id: str, seconds: float, table: str = "default") -> float:
        """As ShardedBufferClient.renew."""
        return await self._run(self._renew(lease_id, seconds, table))

    async def set_trainer_version(self, version: int, table: str = "default") -> int:
        """As ShardedBufferClient.set_trainer_version."""
        return await self._run(self._set_trainer_version(version, table))

    async def reset_offpolicy(
        self, table: str = "default", trainer_version: int | None = None
    ) -> dict[str, dict[str, int]]:
        """As BufferClient.reset_offpolicy, on every shard; each shard's answer by its name."""
        return await self._run(self._reset_offpolicy(table, trainer_version))

    async def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """As BufferClient.admit, on the table's admission shard (`admission_shard`)."""
        return await self._run(self._admit(table, count, wait, grant_seconds))

    async def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant on the shard that granted it."""
        return await self._run(self._on_one(self.admission_shard(grant.table), "finish_grant", grant, accepted))

    async def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        """As ShardedBufferClient.delete."""
        return await self._run(self._delete(list(uids), table, list(groups)))

    async def retire(self, groups: Iterable[str], table: str = "default") -> int:
        """As ShardedBufferClient.retire."""
        return await self._run(self._retire(groups, table))

    async def fail_runs(
        self, uids: Iterable[str], table: str = "default", *, reasons: Iterable[str] = ()
    ) -> FailedRuns:
        """As ShardedBufferClient.fail_runs."""
        return await self._run(self._fail_runs(list(uids), list(reasons), table))

    async def seal(self, group_id: str, table: str = "default") -> int:
        """As ShardedBufferClient.seal."""
        return await self._run(self._on_one(self.shard_map.owner(group_id), "seal", group_id, table))

    async def stats(self, table: str = "") -> BufferStats:
        """As ShardedBufferClient.stats."""
        return await self._run(self._stats(table))

    async def shard_stats(self, table: str = "") -> LiveResult:
        """As ShardedBufferClient.shard_stats."""
        return await self._run(self._live("stats", table))

    async def server_info(self) -> ServerInfo:
        """As ShardedBufferClient.server_info."""
        return await self._run(self._server_info())

    async def create_table(
        self, name: str, *, exist_ok: bool = False, preset: str | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """As ShardedBufferClient.create_table."""
        return await self._run(self._create_table(name, exist_ok, with_preset(preset, settings)))

    async def list_tables(self) -> list[TableInfo]:
        """As ShardedBufferClient.list_tables."""
        return await self._run(self._list_tables())

    async def drop_table(self, name: str) -> int:
        """As ShardedBufferClient.drop_table."""
        return await self._run(self._drop_table(name))
