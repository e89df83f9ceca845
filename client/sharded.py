"""One client for many expbuf shards: ShardedBufferClient and AsyncShardedBufferClient.

Each shard is a plain `expbuf serve`; everything about routing lives here (see routing.py).
A push is split by group and each part goes to the shard that owns its groups, in
parallel. A sampled batch is drawn from every shard in proportion to the ready groups (or
experiences) each holds (`allocate`), so every ready group has the same chance whatever
shard holds it; a shard that does not answer is left out until it does. The parts arrive
in parallel and are joined into one TRXP batch. A leased batch's lease id names the shard
of each part ("s0/lease,s2/lease"), so `ack` and `nack` reach the shards that granted
them. Stats, tables, Get and Delete cover every shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from .client import (
    Batch,
    BufferClient,
    BufferError,
    Grant,
    PushResult,
)
from .experience import Experience
from .routing import ShardMap
from .shard_common import (
    ShardBatch,
    ShardError,
    _merge_push,
    _merge_stats,
    _shard_error,
    _Sharded,
    allocate,
    dns_targets,
)
from .sharded_async import AsyncShardedBufferClient

# How long sample() waits between looks at the shards' ready counts when none can fill a batch.
_POLL_SECONDS = (0.02, 0.5)
# A ready-count probe of one shard: no retries, a short deadline; a shard that fails it is skipped.
_PROBE_SECONDS = 2.0
_MIN_FIELDS = {"min_model_version"}
_MAX_FIELDS = {"max_model_version", "oldest_age_seconds"}


class ShardedBufferClient(_Sharded):
    """BufferClient's methods over a set of shards. Use as a context manager or call close()."""

    _client_class = BufferClient

    def __init__(self, shards: ShardMap | Mapping[str, str] | Sequence[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(shards, *args, **kwargs)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="expbuf-shards")

    def close(self) -> None:
        self._pool.shutdown()
        for client in (*self.clients.values(), *self._probes.values(), *self._retired):
            client.close()

    def __enter__(self) -> ShardedBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _each(self, call: Callable[[str, BufferClient], Any], shards: Iterable[str] | None = None) -> dict[str, Any]:
        """`call` on every shard in parallel; raises ShardError naming the shards that failed."""
        names = list(self.clients if shards is None else shards)
        futures = {name: self._pool.submit(call, name, self.clients[name]) for name in names}
        results, errors = {}, {}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except BufferError as exc:
                errors[name] = exc
        if errors:
            raise _shard_error(errors, self.shard_map.targets, results)
        return results

    def _table_group_by(self, table: str) -> str:
        if table not in self._group_by:
            self.list_tables()
        return self._known_group_by(table)

    def push(self, items: bytes | Iterable[Any], table: str = "default", *, timeout: float | None = None) -> PushResult:
        """Store experiences durably, each group on its shard; the parts go out in parallel."""
        parts = self._split(items, self._table_group_by(table))
        try:
            results = self._each(lambda shard, client: client.push(parts[shard], table, timeout=timeout), parts)
        except ShardError as exc:
            exc.result = _merge_push(exc.result.values())
            raise
        return _merge_push(results.values())

    def _ready(self, table: str, key: str) -> dict[str, int]:
        """Each answering shard's ready count (shards that fail the probe are left out)."""
        futures = {name: self._pool.submit(probe.stats, table) for name, probe in self._probes.items()}
        ready = {}
        for name, future in futures.items():
            try:
                ready[name] = future.result()[table][key]
            except (BufferError, KeyError):
                continue
        return ready

    def sample(
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
    ) -> Iterator[ShardBatch]:
        """Stream batches of whole groups drawn from every shard in proportion to what each holds ready.

        `timeout` is how long each batch may wait for enough ready data over all shards; a shard
        that does not answer is left out meanwhile. With `batch_size`, each shard fills its part
        with whole groups, so a batch may end up to one group per shard past it.
        """
        key, need = self._need(batch_size, num_groups)
        request = {"order": order, "delivery": delivery, "lease_seconds": lease_seconds}
        request |= {"min_model_version": min_model_version, "timeout": 0.0, "max_batches": 1}
        request |= {"trainer_version": trainer_version}
        if trainer_version is not None:  # every shard, the admission shard too, whether or not it holds data
            self.set_trainer_version(trainer_version, table)
        sent = 0
        while not max_batches or sent < max_batches:
            deadline, pause, parts, got = time.monotonic() + timeout, _POLL_SECONDS[0], [], 0
            while True:
                ready, late = self._ready(table, key), time.monotonic() >= deadline
                want = allocate(ready, need - got)
                if sum(want.values()) >= need - got or (late and want):
                    parts += self._fetch(table, key, want, request | {"allow_partial": late})
                    got = sum(self._size(key, part) for _, part in parts)
                if got >= need or late:
                    break
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, _POLL_SECONDS[1])
            if not parts:
                self._nothing(ready, allow_partial, need, key, timeout)
                return
            sent += 1
            yield self._merge(parts, got < need, self.ack, self.nack)
            if got < need:
                return

    def _fetch(self, table: str, key: str, want: Mapping[str, int], request: dict) -> list[tuple[str, Batch]]:
        """One batch of each shard's part, in parallel; a shard that cannot give it now gives nothing."""

        def one(shard: str, count: int) -> list[Batch]:
            size = {"num_groups": count} if key == "groups_ready" else {"batch_size": count}
            return list(self.clients[shard].sample(table, **size, **request))

        futures = {shard: self._pool.submit(one, shard, count) for shard, count in want.items()}
        parts = []
        for shard, future in futures.items():
            try:
                parts += [(shard, batch) for batch in future.result()]
            except BufferError:
                continue  # taken by another trainer meanwhile, filtered out, or the shard went down
        return parts

    def ack(self, lease_id: str, table: str = "default") -> int:
        """Consume a batch's groups on the shards that leased them."""
        return self._end(lease_id, lambda client, lease: client.ack(lease, table))

    def nack(self, lease_id: str, table: str = "default") -> int:
        """Return a batch's groups to the buffers of their shards now."""
        return self._end(lease_id, lambda client, lease: client.nack(lease, table))

    def _end(self, lease_id: str, call: Callable[[BufferClient, str], int]) -> int:
        done, errors = 0, {}
        for shard, lease in self._leases(lease_id):
            try:
                done += call(self.clients[shard], lease)
            except BufferError as exc:
                errors[shard] = exc
        if errors:
            raise _shard_error(errors, self.shard_map.targets, done)
        return done

    def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell every shard's table the trainer's current policy version."""
        return min((self._each(lambda _, c: c.set_trainer_version(version, table))).values())

    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> dict[str, dict[str, int]]:
        """As BufferClient.reset_offpolicy, on every shard; each shard's answer by its name."""
        return self._each(lambda _, c: c.reset_offpolicy(table, trainer_version))

    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """As BufferClient.admit, on the table's admission shard (`admission_shard`)."""
        client = self.clients[self.admission_shard(table)]
        return client.admit(table, count, wait=wait, grant_seconds=grant_seconds)

    def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant on the shard that granted it."""
        return self.clients[self.admission_shard(grant.table)].finish_grant(grant, accepted)

    def get(self, uids: Iterable[str], table: str = "default") -> list[Experience]:
        """The experiences found on any shard, in request order."""
        uids = list(uids)
        found = {exp.eid.uid: exp for part in self._each(lambda _, c: c.get(uids, table)).values() for exp in part}
        return [found[uid] for uid in uids if uid in found]

    def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        uids, groups = list(uids), list(groups)
        return sum(self._each(lambda _, c: c.delete(uids, table, groups=groups)).values())

    def seal(self, group_id: str, table: str = "default") -> int:
        """Complete a pending group on the shard that owns it."""
        return self.clients[self.shard_map.owner(group_id)].seal(group_id, table)

    def stats(self, table: str = "") -> dict[str, dict[str, Any]]:
        """Every table's counters summed over the shards."""
        return _merge_stats(self.shard_stats(table).values())

    def shard_stats(self, table: str = "") -> dict[str, dict[str, dict[str, Any]]]:
        return self._each(lambda _, c: c.stats(table))

    def server_info(self) -> dict[str, dict[str, Any]]:
        return self._each(lambda _, c: c.server_info())

    def create_table(self, name: str, *, exist_ok: bool = False, **settings: Any) -> dict[str, Any]:
        """Create the table on every shard (exist_ok makes a retry after a partial failure safe)."""
        configs = self._each(lambda _, c: c.create_table(name, exist_ok=exist_ok, **settings))
        config = next(iter(configs.values()))
        self._group_by[name] = config.get("group_by") or "task"
        return config

    def list_tables(self) -> list[dict[str, Any]]:
        for client in self.clients.values():
            try:
                tables = client.list_tables()
            except BufferError:
                continue
            return self._remember(tables)
        raise ShardError(grpc.StatusCode.UNAVAILABLE, "no shard answered", list(self.clients))

    def drop_table(self, name: str) -> int:
        self._group_by.pop(name, None)
        return sum(self._each(lambda _, c: c.drop_table(name)).values())


__all__ = ["AsyncShardedBufferClient", "ShardBatch", "ShardError", "ShardedBufferClient", "allocate", "dns_targets"]
