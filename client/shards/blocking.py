"""One client for many expbuf shards: ShardedBufferClient and AsyncShardedBufferClient.

Each shard is a plain `expbuf serve`; everything about routing lives here (see routing.py).
A push is split by group and each part goes to the shard that owns its groups, in
parallel. A sampled batch is drawn from every shard in proportion to the ready groups (or
experiences) each holds (`allocate`), so every ready group has the same chance whatever
shard holds it; a shard that does not answer is left out until it does. The parts arrive
in parallel and are joined into one TRXP batch. A leased batch's lease id names the shard
of each part ("s0/lease,s2/lease"), so `ack` and `nack` reach the shards that granted
them. Stats, tables and Delete cover every shard; Get asks each uid's owner. Datasets of
prompts live on the shards of the map's first epoch, each handing out its part (ledger.py).

The calls' logic is in plans.py, shared with the asyncio client (each call declared once,
rpc/api.py, its route a plan: routes.py); this module makes the calls a plan asks for, in
parallel on a thread pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Unpack

from ..client import BufferClient, BufferError
from ..rpc.api import ShardCalls
from ..rpc.declare import BlockingShards, Turns
from ..rpc.sample_spec import SampleOptions, SampleSpec
from ..schema.routing import ShardMap
from .aio import AsyncShardedBufferClient
from .common import LiveResult, ShardBatch, ShardError, allocate, closed_error, dns_targets
from .poll import Wait
from .pusher import ShardedPusher
from .routes import ShardPlans
from .steps import Call, Emit, Plan, T


class ShardedBufferClient(ShardPlans, BlockingShards, ShardCalls):
    """BufferClient's methods over a set of shards. Use as a context manager or call close()."""

    _client_class = BufferClient
    closed = False  # its close() began

    def __init__(self, shards: ShardMap | Mapping[str, str] | Sequence[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(shards, *args, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="expbuf-shards")

    def close(self) -> None:
        """Close every shard's channel, which cancels the calls in flight (as BufferClient.close),
        then the threads that call the shards in parallel: shut down first, they waited for each
        call in flight to reach its deadline. A call made after is refused CANCELLED."""
        self.closed = True
        for client in (*self.clients.values(), *self._probes.values(), *self._retired):
            client.close()
        self._pool.shutdown()

    def __enter__(self) -> ShardedBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the driver --------------------------------------------------------------------------

    def _call(self, call: Call) -> Any:
        client = call.on or (self._probes if call.quick else self.clients)[call.shard]
        try:
            return getattr(client, call.method)(*call.args, **call.kwargs)
        except BufferError as exc:
            return exc

    def _step(self, step: Any) -> Any:
        if self.closed:
            raise closed_error()
        if isinstance(step, Wait):
            time.sleep(step.seconds)
            return None
        if len(step) == 1:
            return [self._call(step[0])]
        try:
            made = [self._pool.submit(self._call, call) for call in step]
        except RuntimeError:  # its threads shut down: the client closed meanwhile
            raise closed_error() from None
        return [future.result() for future in made]

    def _run(self, plan: Plan[T]) -> T:
        turns = Turns(plan)
        for step in turns:
            turns.answer(self._step(step))
        return turns.result

    # ---- its own calls (the others are declared once: rpc/api.py) -----------------------------

    def pusher(self, table: str = "default", *, window: int = 4, timeout: float | None = None) -> ShardedPusher:
        """Pipelined pushes to `table` over the shards, as BufferClient.pusher: up to `window` (1 to
        64) in flight, each push's parts sent at once to their shards' pushers (one per shard,
        each over its own PushStream). Futures complete in push order, a failed push with a
        ShardError naming its shards and uids. See ShardedPusher."""
        return ShardedPusher(self, table, window, timeout, lambda: self._run(self._group_by_of(table)))

    def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        **options: Unpack[SampleOptions],
    ) -> Iterator[ShardBatch]:
        """Stream batches of whole groups drawn from every shard in proportion to what each holds ready.

        `timeout` is how long each batch may wait for enough ready data over all shards; a shard
        that does not answer is left out meanwhile. With `batch_size`, each shard fills its part
        with whole groups, so a batch may end up to one group per shard past it. `trainer_version`
        is set on every shard that answers and owed to the others (see `set_trainer_version`).
        """
        spec = SampleSpec(table, batch_size, num_groups, **options)
        for step in (turns := Turns(self._sample(spec, self, ShardBatch))):
            if isinstance(step, Emit):
                yield step.batch
            else:
                turns.answer(self._step(step))


__all__ = [
    "AsyncShardedBufferClient",
    "LiveResult",
    "ShardBatch",
    "ShardError",
    "ShardedBufferClient",
    "allocate",
    "dns_targets",
]
