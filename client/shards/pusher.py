"""Pipelined pushes over shards: ShardedPusher and AsyncShardedPusher.

A sharded pusher keeps one pusher per shard (BufferClient.pusher, AsyncBufferClient.pusher),
each over its own PushStream. A push is split by group (common.Sharded.split), and its
parts go at once to their shards' pushers, numbered as the push: each shard stores its parts in
the order of the pushes, the shards in parallel. The push's future completes once every part's
has, in the order of the pushes: with the parts' PushResults merged, or with a ShardError that
names the shards that failed and their errors (each naming the push and its uids), holds what
the other shards stored in `result`, and the failed parts' uids in `uids`. Up to `window` pushes
are in flight, and each shard's pusher retries its parts across a restart of its shard.

ShardWindow, the split and the merge are shared; the two drivers only wait and send.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from ..errors import ExpbufError
from ..pushers.aio import AsyncOrderedFutures, AsyncPusher
from ..pushers.blocking import OrderedFutures, Pusher
from ..pushers.pipeline import Ordered
from ..results import PushResult
from ..rpc import calls
from .common import Sharded, merge_push, shard_error

Parts = dict[str, bytes]  # a push's payload by the shard that owns its groups


@dataclass(eq=False)
class ShardPush:
    """One push of a sharded pusher, from push() until its future is completed."""

    number: int
    targets: dict[str, str]  # its parts' shards and their addresses
    parts: dict[str, PushResult | ExpbufError] = field(default_factory=dict)  # each part's outcome, once known
    outcome: PushResult | ExpbufError | None = None


def split(client: Sharded, items: calls.Items, group_by: str) -> Parts | ExpbufError:
    """The push's parts by shard, or the error of a payload that is not TRXP."""
    try:
        return client.split(items, group_by)
    except ExpbufError as exc:
        return exc


def outcome_of(future: Future[PushResult] | asyncio.Future[PushResult]) -> PushResult | ExpbufError:
    """A part's outcome from its (done) future."""
    error = future.exception()
    if error is None:
        return future.result()
    return error if isinstance(error, ExpbufError) else ExpbufError(grpc.StatusCode.UNKNOWN, str(error))


class ShardWindow(Ordered[ShardPush]):
    """A sharded pusher's pushes in the order pushed, up to `size` of them not yet handed back."""

    def add(self, parts: Parts | ExpbufError, targets: Mapping[str, str]) -> ShardPush:
        """The next push, of its parts; one whose payload could not be split fails at once."""
        number = self.number()
        if isinstance(parts, ExpbufError):
            push = ShardPush(number, {})
            push.outcome = ExpbufError(
                parts.code,
                f"{parts.details} (push {number} of this pusher; its payload is not TRXP, so its uids are unknown)",
                parts.reason,
            )
        else:
            push = ShardPush(number, {shard: targets[shard] for shard in parts})
            if not parts:  # nothing to store: no shard would answer it, and the pushes after it wait
                push.outcome = merge_push([])
        self.pushes.append(push)
        return push

    @staticmethod
    def answered(push: ShardPush, shard: str, outcome: PushResult | ExpbufError) -> None:
        """Shard `shard` answered its part of `push`; once every part is answered, the push's outcome."""
        push.parts[shard] = outcome
        if len(push.parts) < len(push.targets):
            return
        stored = {name: part for name, part in push.parts.items() if isinstance(part, PushResult)}
        failed = {name: part for name, part in push.parts.items() if isinstance(part, ExpbufError)}
        if not failed:
            push.outcome = merge_push(stored.values())
            return
        error = shard_error(failed, push.targets, merge_push(stored.values()))
        error.uids = tuple(uid for part in failed.values() for uid in part.uids)
        push.outcome = error


Q = TypeVar("Q", Pusher, AsyncPusher)


class ShardPushers(Generic[Q]):
    """A sharded pusher's pusher per shard, made when a push first has a part for the shard."""

    def __init__(self, client: Sharded, table: str, window: int, timeout: float | None) -> None:
        self._client, self._table, self._window_size, self._timeout = client, table, window, timeout
        self._pushers: dict[str, tuple[Any, Q]] = {}  # by shard: the client that made its pusher, and the pusher
        self._retired: list[Q] = []  # of shards that moved to another address (set_map)
        self._group_by: str | None = None  # the table's, asked for at the first push

    def _pusher(self, shard: str) -> Q:
        """The shard's pusher, a new one if the shard's client changed."""
        client = self._client.clients[shard]
        made = self._pushers.get(shard)
        if made is not None and made[0] is client:
            return made[1]
        if made is not None:
            self._retired.append(made[1])
        pusher = client.pusher(self._table, window=self._window_size, timeout=self._timeout)
        self._pushers[shard] = (client, pusher)
        return pusher

    def _all(self) -> list[Q]:
        """Every pusher made, the retired ones too."""
        return [pusher for _, pusher in self._pushers.values()] + self._retired


class ShardedPusher(ShardPushers[Pusher], OrderedFutures[ShardWindow]):
    """Up to `window` pushes in flight to one table over the shards, as Pusher: `push()` returns a
    Future at once (waiting only while the window is full); futures complete in push order, each
    with its merged PushResult once every part is durable, or its ShardError (see the module).
    Made by `ShardedBufferClient.pusher()`; close it (or leave its `with`) to wait for every push."""

    def __init__(
        self, client: Sharded, table: str, window: int, timeout: float | None, group_by: Callable[[], str]
    ) -> None:
        ShardPushers.__init__(self, client, table, window, timeout)
        self._ask_group_by = group_by  # the table's grouping, from the shards (the client's plan)
        OrderedFutures.__init__(self, ShardWindow(window))
        self._sending = threading.RLock()  # a push's parts reach each shard's pusher in push order

    def push(self, items: calls.Items) -> Future[PushResult]:
        """Push TRXP bytes, experiences or a ColumnBatch; the future completes when every part is durable
        or one has failed."""
        if self._group_by is None:
            self._group_by = self._ask_group_by()
        parts = split(self._client, items, self._group_by)
        future: Future[PushResult] = Future()
        with self._sending:
            with self._changed:
                self._changed.wait_for(lambda: not self._window.full)
                push = self._window.add(parts, self._client.shard_map.targets)
                self._futures[push.number] = future
            for shard, part in parts.items() if isinstance(parts, dict) else ():
                sent = self._pusher(shard).push_part(part, push.number)
                sent.add_done_callback(functools.partial(self._answered, push, shard))
        self._settle()
        return future

    def flush(self) -> None:
        """Wait until every push made so far is durable or has failed: each shard's pusher waits
        for its parts first, which ends its stream (Pusher.flush)."""
        with self._sending:
            pushers = self._all()
        for pusher in pushers:
            pusher.flush()
        super().flush()

    def close(self) -> None:
        """Wait for every push, then end each shard's stream."""
        self.flush()
        for pusher in self._all():
            pusher.close()

    def __enter__(self) -> ShardedPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answered(self, push: ShardPush, shard: str, future: Future[PushResult]) -> None:
        with self._changed:
            self._window.answered(push, shard, outcome_of(future))
        self._settle()


class AsyncShardedPusher(ShardPushers[AsyncPusher], AsyncOrderedFutures[ShardWindow]):
    """ShardedPusher for AsyncShardedBufferClient: `await push()` returns an asyncio Future at once."""

    def __init__(
        self, client: Sharded, table: str, window: int, timeout: float | None, group_by: Callable[[], Awaitable[str]]
    ) -> None:
        ShardPushers.__init__(self, client, table, window, timeout)
        self._ask_group_by = group_by  # the table's grouping, from the shards (the client's plan)
        AsyncOrderedFutures.__init__(self, ShardWindow(window))
        self._sending = asyncio.Lock()  # a push's parts reach each shard's pusher in push order
        self._making: set[asyncio.Task[asyncio.Future[PushResult]]] = set()  # pushes whose parts are being sent

    async def push(self, items: calls.Items) -> asyncio.Future[PushResult]:
        """Push TRXP bytes, experiences or a ColumnBatch; the future completes when every part is durable
        or one has failed. A push whose caller is cancelled as it waits (for room, or for a shard to
        read a part) is made all the same: a push with a part never handed to its shard's pusher
        would never complete, nor any push after it."""
        if self._group_by is None:
            self._group_by = await self._ask_group_by()
        parts = split(self._client, items, self._group_by)
        making = asyncio.ensure_future(self._make(parts))
        self._making.add(making)
        making.add_done_callback(self._making.discard)
        return await asyncio.shield(making)

    async def _make(self, parts: Parts | ExpbufError) -> asyncio.Future[PushResult]:
        """The push of `parts`, its future; every part handed to its shard's pusher, in push order."""
        future: asyncio.Future[PushResult] = asyncio.get_running_loop().create_future()
        async with self._sending:
            await self._room()
            push = self._window.add(parts, self._client.shard_map.targets)
            self._futures[push.number] = future
            for shard, part in parts.items() if isinstance(parts, dict) else ():
                sent = await self._pusher(shard).push_part(part, push.number)
                sent.add_done_callback(functools.partial(self._answered, push, shard))
        self._settle()
        return future

    async def flush(self) -> None:
        """Wait until every push made so far is durable or has failed: each shard's pusher waits
        for its parts first, which ends its stream (AsyncPusher.flush)."""
        await asyncio.gather(*self._making, return_exceptions=True)  # pushes whose callers were cancelled
        for pusher in self._all():
            await pusher.flush()
        await super().flush()

    async def close(self) -> None:
        """Wait for every push, then end each shard's stream."""
        await self.flush()
        for pusher in self._all():
            await pusher.close()

    async def __aenter__(self) -> AsyncShardedPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _answered(self, push: ShardPush, shard: str, future: asyncio.Future[PushResult]) -> None:
        self._window.answered(push, shard, outcome_of(future))
        self._settle()
