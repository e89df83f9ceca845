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

The calls' logic is in plans.py, shared with the asyncio client; this module makes
the calls a plan asks for, in parallel on a thread pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Unpack

from ..client import BufferClient, BufferError, Grant, PushResult
from ..results import BufferStats, FailedRuns, ServerInfo, TableInfo
from ..rpc import calls
from ..rpc.api import Calls
from ..rpc.declare import BlockingShards, Turns
from ..rpc.sample_spec import SampleOptions, SampleSpec
from ..schema.routing import ShardMap
from ..schema.table_presets import with_preset
from ..schema.table_settings import TableSettings
from .aio import AsyncShardedBufferClient
from .common import LiveResult, ShardBatch, ShardError, allocate, dns_targets
from .plans import Call, Emit, Plan, T
from .poll import Wait
from .pusher import ShardedPusher
from .routes import ShardPlans


class ShardedBufferClient(ShardPlans, BlockingShards, Calls):
    """BufferClient's methods over a set of shards. Use as a context manager or call close()."""

    _client_class = BufferClient

    def __init__(self, shards: ShardMap | Mapping[str, str] | Sequence[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(shards, *args, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="expbuf-shards")

    def close(self) -> None:
        """Close every shard's channel and the threads that call the shards in parallel."""
        self._pool.shutdown()
        for client in (*self.clients.values(), *self._probes.values(), *self._retired):
            client.close()

    def __enter__(self) -> ShardedBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the driver --------------------------------------------------------------------------

    def _call(self, call: Call) -> Any:
        client = (self._probes if call.quick else self.clients)[call.shard]
        try:
            result = getattr(client, call.method)(*call.args, **call.kwargs)
            return list(result) if call.method == "sample" else result
        except BufferError as exc:
            return exc

    def _step(self, step: Any) -> Any:
        if isinstance(step, Wait):
            time.sleep(step.seconds)
            return None
        if len(step) == 1:
            return [self._call(step[0])]
        return [future.result() for future in [self._pool.submit(self._call, call) for call in step]]

    def _run(self, plan: Plan[T]) -> T:
        turns = Turns(plan)
        for step in turns:
            turns.answer(self._step(step))
        return turns.result

    # ---- BufferClient's methods --------------------------------------------------------------

    def push(self, items: calls.Items, table: str = "default", *, timeout: float | None = None) -> PushResult:
        """Store experiences durably, each group on its shard; the parts go out in parallel."""
        return self._run(self._push(items, table, timeout))

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

    def ack(self, lease_id: str, table: str = "default") -> int:
        """Consume a batch's groups on the shards that leased them."""
        return self._run(self._end(lease_id, "ack", table))

    def nack(self, lease_id: str, table: str = "default") -> int:
        """Return a batch's groups to the buffers of their shards now."""
        return self._run(self._end(lease_id, "nack", table))

    def renew(self, lease_id: str, seconds: float, table: str = "default") -> float:
        """Renew a batch's lease on the shards that leased it; returns the earliest end."""
        return self._run(self._renew(lease_id, seconds, table))

    def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell every shard's table the trainer's current policy version; the lowest one a shard holds.

        A shard that does not answer is owed the version, sent the next time it answers (`pending`).
        """
        return self._run(self._set_trainer_version(version, table))

    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> dict[str, dict[str, int]]:
        """As BufferClient.reset_offpolicy, on every shard; each shard's answer by its name."""
        return self._run(self._reset_offpolicy(table, trainer_version))

    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """As BufferClient.admit, on the table's admission shard (`admission_shard`)."""
        return self._run(self._admit(table, count, wait, grant_seconds))

    def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant on the shard that granted it."""
        return self._run(self._on_one(self.admission_shard(grant.table), "finish_grant", grant, accepted))

    def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        """As BufferClient.delete, on every shard (admin scope); the experiences removed over all of them.

        Raises ShardError naming a shard that did not answer or refused, its `result` what each of
        the others removed, by shard.
        """
        return self._run(self._delete(list(uids), table, list(groups)))

    def retire(self, groups: Iterable[str], table: str = "default") -> int:
        """As BufferClient.retire, each group on the shard that owns it; the groups retired.

        Raises ShardError naming a shard that did not answer or refused, its `result` what each of
        the others retired, by shard (a retry of the whole call is safe).
        """
        return self._run(self._retire(groups, table))

    def fail_runs(self, uids: Iterable[str], table: str = "default", *, reasons: Iterable[str] = ()) -> FailedRuns:
        """As BufferClient.fail_runs, each run on the shard that owns its group. Raises ShardError
        naming a shard that did not answer or refused, its `result` what the others did."""
        return self._run(self._fail_runs(list(uids), list(reasons), table))

    def seal(self, group_id: str, table: str = "default") -> int:
        """Complete a pending group on the shard that owns it."""
        return self._run(self._on_one(self.shard_map.owner(group_id), "seal", group_id, table))

    def stats(self, table: str = "") -> BufferStats:
        """Every table's stats merged over the shards that answer (TableStats.merged); `.missing` names the others."""
        return self._run(self._stats(table))

    def shard_stats(self, table: str = "") -> LiveResult:
        """Each answering shard's stats, by shard; `.missing` names the others."""
        return self._run(self._live("stats", table))

    def server_info(self) -> ServerInfo:
        """The answering shards' infos combined, each in `.shards`; `.missing` names the others."""
        return self._run(self._server_info())

    def create_table(
        self, name: str, *, exist_ok: bool = False, preset: str | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """Create the table on every shard (exist_ok makes a retry after a partial failure safe),
        with the settings of BufferClient.create_table, a `preset` among them.

        With exist_ok, a shard that does not answer is owed the table, created the next time it
        answers; the config returned names it in `.missing`.
        """
        return self._run(self._create_table(name, exist_ok, with_preset(preset, settings)))

    def list_tables(self) -> list[TableInfo]:
        """Every table's settings, as the first shard that answers holds them."""
        return self._run(self._list_tables())

    def drop_table(self, name: str) -> int:
        """Drop the table on every shard (admin scope); the experiences it held over all of them.

        Raises ShardError naming a shard that did not answer or refused, its `result` what each of
        the others dropped, by shard.
        """
        return self._run(self._drop_table(name))


__all__ = [
    "AsyncShardedBufferClient",
    "LiveResult",
    "ShardBatch",
    "ShardError",
    "ShardedBufferClient",
    "allocate",
    "dns_targets",
]
