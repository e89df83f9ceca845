"""What the blocking and asyncio sharded clients share: their errors, batches and degraded
results, the shard map's connections, splitting a push by shard, sharing a batch out among
shards, and merging what the shards answer. Their calls' logic is in plans.py."""

from __future__ import annotations

import itertools
import random
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import grpc

from .. import trxp
from ..columns import join_columns
from ..errors import BufferError
from ..results import AsyncBatch, Batch, Leases, PushResult, TableInfo
from ..rpc import calls
from ..rpc.connection import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT, ChannelOptions, Tls
from ..rpc.sample_spec import SampleSpec
from ..schema.experience import EID
from ..schema.reasons import Reason
from ..schema.routing import ShardMap, group_key, rendezvous, shard_names
from ..trxp.column_batch import wire as column_wire

# A probe of one shard (its ready count, or any small call while it is believed down): no retries,
# no wait for a shard that is down, a short deadline; a shard that fails it is left out.
_PROBE_SECONDS = 2.0


class ShardError(BufferError):
    """A call failed on one or more shards; `shards` names them, `result` holds what the others did,
    `reason` is the first failed shard's."""

    def __init__(
        self, code: grpc.StatusCode, details: str, shards: Sequence[str], result: Any = None, reason: str | None = None
    ) -> None:
        super().__init__(code, details, reason)
        self.shards = list(shards)
        self.result = result


def closed_error() -> ShardError:
    """What a call made on a closed sharded client raises, as one made on a closed channel."""
    return ShardError(grpc.StatusCode.CANCELLED, "the sharded client was closed", [])


class LiveResult(dict):
    """What the shards that answered returned, as one server's call would; `missing` names the
    shards that did not answer (UNAVAILABLE or DEADLINE_EXCEEDED), with their error."""

    def __init__(self, answered: Mapping[str, Any], missing: Mapping[str, str]) -> None:
        super().__init__(answered)
        self.missing = dict(missing)


@dataclass(repr=False)
class ShardBatch(Batch):
    """A Batch and the shards its groups came from; its lease id is "shard/lease[,shard/lease...]"."""

    shards: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, shards={self.shards})"


class AsyncShardBatch(AsyncBatch, ShardBatch):
    """A ShardBatch of the asyncio sharded client: `ack`, `nack` and `renew` are coroutine functions."""


def dns_targets(name: str, port: int = 50051) -> dict[str, str]:
    """Shards behind a headless Service: its A records, named by their reverse DNS entries.

    A StatefulSet pod's address maps back to `pod.service.namespace.svc...`, so the shard is
    named after its pod (`expbuf-0`) and reached by that stable name, whatever address the pod
    has after a restart. An address without a reverse entry is named and reached by itself.
    """
    try:
        infos = socket.getaddrinfo(name, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise BufferError(grpc.StatusCode.UNAVAILABLE, f"cannot resolve {name}: {exc}") from None
    targets: dict[str, str] = {}
    for address in sorted({str(info[4][0]) for info in infos}):
        try:
            host = socket.gethostbyaddr(address)[0]
        except OSError:
            host = address
        shard = host if host == address else host.split(".")[0]
        targets.setdefault(shard, f"{host}:{port}")
    return targets


def merge_push(results: Iterable[PushResult]) -> PushResult:
    merged = PushResult([], [], [])
    for result in results:
        merged.stored += result.stored
        merged.duplicates += result.duplicates
        merged.completed_groups += result.completed_groups
        merged.stale += result.stale
        merged.partial += result.partial
    return merged


def shard_error(errors: Mapping[str, BufferError], targets: Mapping[str, str], result: Any = None) -> ShardError:
    first = next(iter(errors.values()))
    details = "; ".join(f"shard {name} ({targets[name]}): {exc}" for name, exc in errors.items())
    return ShardError(first.code, details, list(errors), result, first.reason)


def allocate(ready: Mapping[str, int], need: int) -> dict[str, int]:
    """Split `need` groups (or experiences) over the shards in proportion to what each holds ready.

    Each shard gets the whole part of its share, and one seat more with the chance of its
    share's fraction, so that its part is its share on average and every ready group has the
    same chance to be in a batch whatever shard holds it. The seats left over are drawn at once
    (systematic sampling: the fractions laid end to end, a seat at each whole step from one
    random start): drawn one at a time, weighted by the fractions, each shard's chance was its
    fraction only where one seat was left over. With less ready than `need`, every shard gives
    all it has.
    """
    total = sum(ready.values())
    if total <= need:
        return {shard: count for shard, count in ready.items() if count > 0}
    parts: dict[str, int] = {}
    seat, end = random.randrange(total), 0  # in whole numbers of 1 / total: the fractions add up exactly
    for shard, count in ready.items():
        parts[shard], fraction = divmod(need * count, total)
        end += fraction
        if seat < end:  # a fraction is below 1: it holds one seat at most
            parts[shard] += 1
            seat += total
    return {shard: count for shard, count in parts.items() if count > 0}


class Sharded:
    """The map, the per-shard clients, and the rules shared by the blocking and asyncio clients."""

    _client_class: type

    def __init__(
        self,
        shards: ShardMap | Mapping[str, str] | Sequence[str],
        token: str | None = None,
        tls: Tls | bool | None = None,
        **options: Unpack[ChannelOptions],
    ) -> None:
        """Clients of the shards, each with the settings of one BufferClient (token, tls, timeout, ...)."""
        if isinstance(shards, str):
            raise TypeError("pass a list of targets, a {name: target} dict or a ShardMap, not one string")
        self.timeout = options.get("timeout", DEFAULT_TIMEOUT)
        self.max_message_bytes = options.get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)  # each shard's client's
        self._options: dict[str, Any] = {"token": token, "tls": tls, **options}
        self.shard_map = shards if isinstance(shards, ShardMap) else ShardMap.of(shards)
        self.clients: dict[str, Any] = {}
        self._probes: dict[str, Any] = {}
        self._group_by: dict[str, str] = {}
        self._retired: list[Any] = []
        self._connect()

    @classmethod
    def from_dns(cls, name: str, port: int = 50051, shard_map: str | None = None, **options: Any) -> Any:
        """Shards found by a headless Service's DNS name (one epoch of every shard found).

        A set that has grown needs its epochs: pass the map's JSON as `shard_map`. Its shards
        are then reached as `{shard}.{name}:{port}` (a StatefulSet pod's stable DNS name),
        whether or not they answer right now, so routing does not change while one is down.
        """
        if not shard_map:
            return cls(ShardMap.of(dns_targets(name, port)), **options)
        stable = {shard: f"{shard}.{name}:{port}" for shard in shard_names(shard_map)}
        return cls(ShardMap.from_json(shard_map, stable), **options)

    @classmethod
    def from_ray(cls, namespace: str, name: str = "expbuf", **options: Any) -> Any:
        """Shards started by `expbuf.ray.start_shards` in a Ray namespace (needs `ray.init()` first)."""
        from ..ray_registry import shard_map

        return cls(shard_map(namespace, name), **options)

    def set_map(self, shard_map: ShardMap) -> None:
        """Adopt a new shard map (a new epoch, or shards at new addresses)."""
        self.shard_map = shard_map
        self._connect()

    def _connect(self) -> None:
        """Clients for the map's shards, reusing those whose address is unchanged.

        A replaced client may still be in use by another thread's call, so it is closed with
        this client, not now.
        """
        make = type(self)._client_class
        clients, probes = dict(self.clients), dict(self._probes)
        for name in self.shard_map.shards:
            target = self.shard_map.targets[name]
            if name in clients and clients[name].target == target:
                continue
            self._retired += [c for c in (clients.get(name), probes.get(name)) if c is not None]
            clients[name] = make(target, **self._options)
            probes[name] = make(
                target, **{**self._options, "retries": 0, "wait_for_ready": False, "timeout": _PROBE_SECONDS}
            )
        self.clients, self._probes = clients, probes

    def split(self, items: calls.Items, group_by: str) -> dict[str, bytes]:
        """The payload's items by the shard that owns their groups (grouped by `group_by`), each
        shard's as TRXP bytes (or a batch of columns' as a batch of columns); a payload that is all
        one shard's goes unchanged."""
        payload = calls.payload(items)
        try:
            if column_wire.is_columns(payload):
                return self._split_columns(column_wire.read(payload), payload, group_by)
            parsed = trxp.parse(payload)
        except trxp.TrxpError as exc:
            raise BufferError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), Reason.INVALID_PAYLOAD) from None
        parts: dict[str, list[trxp.RawItem]] = {}
        for item in parsed:
            parts.setdefault(self.shard_map.owner(group_key(item.eid, group_by)), []).append(item)
        if len(parts) == 1:
            return {next(iter(parts)): payload}
        return {shard: trxp.build(part) for shard, part in parts.items()}

    def _split_columns(self, batch: column_wire.ColumnPayload, payload: bytes, group_by: str) -> dict[str, bytes]:
        """split() of a batch of columns: each shard's experiences as a batch of columns, the whole
        checked once as the server checks it before any part goes."""
        for _ in batch.items():
            pass
        rows: dict[str, list[int]] = {}
        for row, eid in enumerate(batch.eids):
            rows.setdefault(self.shard_map.owner(group_key(EID(**eid), group_by)), []).append(row)
        if len(rows) == 1:
            return {next(iter(rows)): payload}
        return {shard: column_wire.select(batch, indices) for shard, indices in rows.items()}

    def _leases(self, lease_id: str) -> list[tuple[str, str]]:
        """(shard, lease) pairs of a batch's lease id, "shard/lease[,shard/lease...]"."""
        pairs = [part.partition("/") for part in lease_id.split(",")]
        if not all(sep and shard in self.clients and lease for shard, sep, lease in pairs):
            raise BufferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease id {lease_id[:80]!r} does not name shards of this client (expected shard/lease[,...])",
                Reason.INVALID_REQUEST,
            )
        return [(shard, lease) for shard, _, lease in pairs]

    @staticmethod
    def _merge(
        parts: list[tuple[str, Batch]], spec: SampleSpec, partial: bool, leases: Leases, kind: type[ShardBatch]
    ) -> ShardBatch:
        """One batch of the parts drawn from several shards for `spec`; its lease id names each part's shard."""
        columns = parts[0][1].columns
        if len(parts) == 1 or parts[0][1].columnar:
            payload = parts[0][1].payload
        else:
            payload = trxp.build([item for _, part in parts for item in trxp.parse(part.payload, trusted=True)])
        if len(parts) > 1 and parts[0][1].columnar:
            bases = itertools.accumulate((len(part.uids) for _, part in parts[:-1]), initial=0)
            columns = join_columns(
                [
                    (range(base, base + len(part.uids)), part.columns)
                    for base, (_, part) in zip(bases, parts, strict=True)
                ],
                spec.fields or (),
            )
        return kind(
            payload=payload,
            columns=columns,
            uids=[uid for _, part in parts for uid in part.uids],
            group_ids=[group for _, part in parts for group in part.group_ids],
            lease_id=",".join(f"{shard}/{part.lease_id}" for shard, part in parts if part.lease_id),
            lease_expires=min(part.lease_expires for _, part in parts),
            partial=partial or any(part.partial for _, part in parts),
            table=parts[0][1].table,
            times_sampled=[times for _, part in parts for times in part.times_sampled],
            advantage_values=(  # where every part has its own
                [value for _, part in parts for value in part.advantage_values]
                if all(len(part.advantage_values) == len(part.uids) for _, part in parts)
                else []
            ),
            _leases=leases,
            shards=list(dict.fromkeys(shard for shard, _ in parts)),
        )

    @staticmethod
    def _size(spec: SampleSpec, batch: Batch) -> int:
        """A fetched part's size in the unit the spec counts: groups or experiences."""
        return len(batch.groups) if spec.by_groups else len(batch.uids)

    def _remember(self, tables: list[TableInfo]) -> list[TableInfo]:
        """Keep each table's grouping: the client needs it to route, and it never changes."""
        for config in tables:
            self._group_by[config.name] = config.group_by
        return tables

    def admission_shard(self, table: str) -> str:
        """The one shard that admits a table's rollouts, so AReaL's bound holds over all shards.

        Rendezvous on the table's name over the first epoch's shards: adding shards later
        never moves a table's admission, and with it the count of rollouts submitted.
        """
        return rendezvous(f"admit/{table}", self.shard_map.epochs[0].shards)

    def _known_group_by(self, table: str) -> str:
        if table not in self._group_by:
            raise BufferError(grpc.StatusCode.NOT_FOUND, f"table '{table[:80]}' does not exist on the shards")
        return self._group_by[table]
