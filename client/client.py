"""Thin clients of the expbuf service: BufferClient (blocking) and AsyncBufferClient (asyncio).

Push is idempotent on the server (a retried payload is reported as duplicates), so
pushes and reads are retried with backoff when the server is UNAVAILABLE. Every call
has a deadline. Errors are raised as ExpbufError (errors.py), of the subclass of their gRPC status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from . import trxp, wire
from .errors import BufferError as BufferError  # the old name, for code that imports it from here
from .errors import ExpbufError
from .results import AsyncBatch, Batch, ExperiencePage, GetResult, Grant, ListedExperience, PushResult

T = TypeVar("T")
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# A server that restarts is reached again within about 2 s: gRPC's own reconnect backoff grows
# to 120 s, which would keep a restarted server (or shard) unused that long after it is back.
_RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


@dataclass(frozen=True)
class Tls:
    """TLS settings: server CA (None = system roots) and, for mutual TLS, a client pair."""

    root_certificates: str | bytes | None = None
    certificate_chain: str | bytes | None = None
    private_key: str | bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: each setting a path to a PEM file, or the PEM bytes."""

        def read(value: str | bytes | None) -> bytes | None:
            return Path(value).read_bytes() if isinstance(value, str) else value

        return grpc.ssl_channel_credentials(
            read(self.root_certificates), read(self.private_key), read(self.certificate_chain)
        )


def _payload(items: bytes | Iterable[Any]) -> bytes:
    if isinstance(items, (bytes, bytearray, memoryview)):
        return bytes(items)
    return trxp.encode(items)


def _sample_request(
    table: str,
    batch_size: int | None,
    num_groups: int | None,
    order: str,
    delivery: str,
    lease_seconds: float,
    timeout: float,
    max_batches: int,
    min_model_version: int | None,
    allow_partial: bool,
    trainer_version: int | None = None,
    window: int = 1,
) -> pb.SampleRequest:
    if bool(batch_size) == bool(num_groups):
        raise ValueError("pass exactly one of batch_size (experiences) or num_groups (whole groups)")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive integer (batches ahead), got {window!r}")
    return pb.SampleRequest(
        table=table,
        batch_size=batch_size or 0,
        num_groups=num_groups or 0,
        **wire.order_fields(order),
        delivery=wire.enum_value(wire.DELIVERY, "delivery", delivery),
        lease_seconds=lease_seconds,
        wait_seconds=timeout,
        allow_partial=allow_partial,
        max_batches=max_batches,
        min_model_version=min_model_version or 0,
        has_min_model_version=min_model_version is not None,
        trainer_version=trainer_version or 0,
        has_trainer_version=trainer_version is not None,
        window=window,
    )


def _trainer_version_request(version: int, table: str) -> pb.SetTrainerVersionRequest:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    return pb.SetTrainerVersionRequest(table=table, version=version)


def _reset_request(table: str, trainer_version: int | None) -> pb.ResetOffPolicyRequest:
    if trainer_version is None:
        return pb.ResetOffPolicyRequest(table=table)
    _trainer_version_request(trainer_version, table)
    return pb.ResetOffPolicyRequest(table=table, trainer_version=trainer_version, has_trainer_version=True)


def _reset_result(reply: pb.ResetOffPolicyReply) -> dict[str, int]:
    return {"trainer_version": reply.trainer_version, "submitted": reply.submitted}


def _create_table_request(name: str, exist_ok: bool, settings: dict[str, Any]) -> pb.CreateTableRequest:
    settings = dict(settings)
    capacity = settings.pop("capacity", None)
    if capacity is not None:
        settings["capacity_experiences"] = capacity
    return pb.CreateTableRequest(config=wire.table_to_proto({"name": name, **settings}), exist_ok=exist_ok)


def _batch(reply: pb.SampleReply, table: str, ack: Callable, nack: Callable, kind: type[Batch] = Batch) -> Batch:
    return kind(
        payload=reply.payload,
        uids=list(reply.uids),
        group_ids=list(reply.group_ids),
        lease_id=reply.lease_id,
        lease_expires=reply.lease_expires_unix,
        partial=reply.partial,
        table=table,
        times_sampled=list(reply.times_sampled),
        _ack=ack,
        _nack=nack,
    )


def _confirmation(received: int, *, stop: bool = False) -> pb.SampleRequest:
    """Tells the server that `received` batches arrived, which frees room in the window for
    more (or, with `stop`, asks for nothing more: batches already on their way return to
    the buffer)."""
    return pb.SampleRequest(received=received, stop=stop)


# How long a stream the caller left may take to hand back the batches already on their way.
_STOP_SECONDS = 5.0


class _SampleRequests:
    """The request side of a blocking Sample stream: the request, then one confirmation
    per batch received, until closed."""

    def __init__(self, first: pb.SampleRequest) -> None:
        self._queue: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        self._queue.put(first)

    def __iter__(self) -> _SampleRequests:
        return self

    def __next__(self) -> pb.SampleRequest:
        request = self._queue.get()
        if request is None:
            raise StopIteration
        return request

    def confirm(self, received: int, *, stop: bool = False) -> None:
        self._queue.put(_confirmation(received, stop=stop))

    def close(self) -> None:
        self._queue.put(None)


def _push_result(reply: pb.PushReply) -> PushResult:
    return PushResult(
        list(reply.stored_uids), list(reply.duplicate_uids), list(reply.completed_groups), list(reply.stale_uids)
    )


def _admit_request(table: str, count: int, wait: float, grant_seconds: float) -> pb.AdmitRequest:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    return pb.AdmitRequest(table=table, count=count, wait_seconds=wait, grant_seconds=grant_seconds)


def _finish_request(grant: Grant, accepted: int | None) -> pb.FinishGrantRequest:
    return pb.FinishGrantRequest(table=grant.table, grant_id=grant.grant_id, accepted=accepted)


class _Base:
    """Settings and channel shared by the blocking and the asyncio client."""

    _insecure_channel: Callable[..., Any]
    _secure_channel: Callable[..., Any]

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        token: str | None = None,
        tls: Tls | bool | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """Connect to `target` (HOST:PORT). `token` is sent as a bearer token; `tls` is a Tls
        (a CA, and a client pair for mutual TLS) or True for the system's CAs. Every call has a
        deadline of `timeout` seconds; pushes and reads are retried up to `retries` times while
        the server is UNAVAILABLE (safe: a push is idempotent). `max_message_bytes` must be at
        least the server's to receive its largest batches. The channel opens lazily::

            with BufferClient("127.0.0.1:50051", token=os.environ["EXPBUF_TOKEN"]) as client:
                client.push(experiences, table="grpo8")
        """
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *_RECONNECT,
        ]
        if tls:
            credentials = (tls if isinstance(tls, Tls) else Tls()).credentials()
            self._channel = type(self)._secure_channel(target, credentials, options=options)
        else:
            self._channel = type(self)._insecure_channel(target, options=options)
        self._stub = pb_grpc.ExperienceBufferStub(self._channel)

    def _retry_pause(self, exc: grpc.RpcError, retry: bool, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before retrying an idempotent call the server could not take; None = give up."""
        if not retry or exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            return None
        pause = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
        return pause if time.monotonic() + pause < deadline else None


class BufferClient(_Base):
    """Blocking client. Use as a context manager or call close()."""

    _insecure_channel = staticmethod(grpc.insecure_channel)
    _secure_channel = staticmethod(grpc.secure_channel)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., T], request: Any, *, retry: bool, timeout: float | None = None) -> T:
        deadline = time.monotonic() + (timeout or self.timeout)
        attempt = 0
        while True:
            try:
                return method(request, timeout=max(0.001, deadline - time.monotonic()), metadata=self._metadata)
            except grpc.RpcError as exc:
                pause = self._retry_pause(exc, retry, attempt, deadline)
                if pause is None:
                    raise ExpbufError(exc.code(), exc.details() or "") from None
                attempt += 1
                time.sleep(pause)

    def push(self, items: bytes | Iterable[Any], table: str = "default", *, timeout: float | None = None) -> PushResult:
        """Store TRXP bytes or experiences (expbuf's or Trinity-RFT's) durably."""
        request = pb.PushRequest(table=table, payload=_payload(items))
        return _push_result(self._call(self._stub.Push, request, retry=True, timeout=timeout))

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
        window: int = 2,
    ) -> Iterator[Batch]:
        """Stream batches of whole groups; `timeout` is how long each batch may wait for data.

        Each batch is confirmed to the server as it arrives, which also asks for more:
        the server keeps up to `window` batches on their way while the caller works on
        this one (a credit window: 1 to 8, the server's MAX_WINDOW; 1 is one batch ahead,
        with a round trip per batch; 2, the default, hides that round trip). A consumed
        batch leaves the buffer once it has arrived here; the batches still on their way
        when the caller stops iterating return to the buffer, as do leases not yet here.
        """
        request = _sample_request(
            table,
            batch_size,
            num_groups,
            order,
            delivery,
            lease_seconds,
            timeout,
            max_batches,
            min_model_version,
            allow_partial,
            trainer_version,
            window,
        )
        requests = _SampleRequests(request)
        stream = self._stub.Sample(requests, metadata=self._metadata)
        received = 0
        try:
            for reply in stream:
                received += 1
                requests.confirm(received)
                yield _batch(reply, table, self.ack, self.nack)
        except grpc.RpcError as exc:
            raise ExpbufError(exc.code(), exc.details() or "") from None
        finally:
            if stream.running():  # the caller stopped early: end the stream cleanly
                requests.confirm(received, stop=True)
                timer = threading.Timer(_STOP_SECONDS, stream.cancel)
                timer.start()
                with contextlib.suppress(grpc.RpcError):
                    for _ in stream:  # batches already on their way go back to the buffer
                        pass
                timer.cancel()
            requests.close()

    def ack(self, lease_id: str, table: str = "default") -> int:
        """Consume the groups of a lease (of `table`, taken with this client's token)."""
        return self._call(self._stub.Ack, pb.AckRequest(table=table, lease_id=lease_id), retry=False).acked

    def nack(self, lease_id: str, table: str = "default") -> int:
        """Return the groups of a lease to the buffer now."""
        return self._call(self._stub.Nack, pb.NackRequest(table=table, lease_id=lease_id), retry=False).requeued

    def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell the table the trainer's current policy version (staleness is measured from it).
        Returns the version stored: it only moves forward, so a lower one keeps the table's."""
        request = _trainer_version_request(version, table)
        return self._call(self._stub.SetTrainerVersion, request, retry=True).version

    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> dict[str, int]:
        """Admin: reset the table's off-policy state for a job that starts over: the trainer
        version becomes `trainer_version` (None: unset), backwards too, and admission counts
        only the rollouts of grants still open. Returns both (trainer_version -1 = unset)."""
        request = _reset_request(table, trainer_version)
        return _reset_result(self._call(self._stub.ResetOffPolicy, request, retry=True))

    def writers(self, table: str = "default", change: int = 0) -> tuple[int, bool]:
        """Open (+1) or close (-1) a writer of the table, or read (0): (writers open, done),
        done once every writer that opened has closed (the table's end of data)."""
        reply = self._call(self._stub.Writers, pb.WritersRequest(table=table, change=change), retry=change == 0)
        return reply.open, reply.done

    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """How many of `count` rollouts may start now under the table's staleness bound,
        waiting up to `wait` seconds for room. Finish the grant when the rollouts are done
        (`finish_grant`); a grant not finished within grant_seconds gives its room back."""
        request = _admit_request(table, count, wait, grant_seconds)
        reply = self._call(self._stub.Admit, request, retry=False, timeout=wait + self.timeout)
        return Grant(reply.granted, reply.grant_id, reply.expires_unix, table)

    def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant: `accepted` rollouts (None: all) stay counted; the others' room comes back."""
        return self._call(self._stub.FinishGrant, _finish_request(grant, accepted), retry=False).returned

    def get(self, uids: Iterable[str], table: str = "default") -> GetResult:
        """The stored experiences among uids, in request order; `.missing_uids` lists the others."""
        reply = self._call(self._stub.Get, pb.GetRequest(table=table, uids=list(uids)), retry=True)
        return _get_result(reply)

    def list_experiences(
        self,
        table: str = "default",
        *,
        states: Iterable[str] = (),
        min_model_version: int | None = None,
        max_model_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> ExperiencePage:
        """A page of the table's live experiences in insertion order, optionally of some states and
        model versions; page on with `after=page.next` until `page.done`. Example::

            page = client.list_experiences("grpo8", states=["ready"])
            experiences = client.get([e.uid for e in page.experiences], table="grpo8")
        """
        request = _list_request(table, states, min_model_version, max_model_version, after, limit)
        return _page(self._call(self._stub.ListExperiences, request, retry=True))

    def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        """Remove experiences by uid and whole groups by id, with their records, so they may be pushed again
        (admin scope). Returns how many experiences were removed."""
        request = pb.DeleteRequest(table=table, uids=list(uids), group_ids=list(groups))
        return self._call(self._stub.Delete, request, retry=False).deleted

    def seal(self, group_id: str, table: str = "default") -> int:
        """Complete a pending group now, with the runs it has; its advantages are computed over them.
        Returns the group's size."""
        return self._call(self._stub.Seal, pb.SealRequest(table=table, group_id=group_id), retry=False).size

    def stats(self, table: str = "") -> dict[str, dict[str, Any]]:
        """Counts by state, bytes, groups, totals, trainer version and shaping counts of one table,
        or of every table when `table` is empty, keyed by table name::

            ready = client.stats("grpo8")["grpo8"]["ready"]
        """
        reply = self._call(self._stub.Stats, pb.StatsRequest(table=table), retry=True)
        return {t.name: _fields(t) for t in reply.tables}

    def server_info(self) -> dict[str, Any]:
        """The server's version, uptime, storage and map use, and the device advantages run on."""
        return _fields(self._call(self._stub.ServerInfo, pb.ServerInfoRequest(), retry=True))

    def create_table(self, name: str, *, exist_ok: bool = False, **settings: Any) -> dict[str, Any]:
        """Create a table; settings use the TOML names (group_by, group_size, estimator, capacity, ...)."""
        request = _create_table_request(name, exist_ok, settings)
        return wire.table_from_proto(self._call(self._stub.CreateTable, request, retry=False).config)

    def list_tables(self) -> list[dict[str, Any]]:
        """Every table's settings, under the names of a TOML `[[tables]]` block."""
        reply = self._call(self._stub.ListTables, pb.ListTablesRequest(), retry=True)
        return [wire.table_from_proto(t) for t in reply.tables]

    def drop_table(self, name: str) -> int:
        """Drop a table with every experience, group, lease and counter in it (admin scope).
        Returns how many experiences it held."""
        return self._call(self._stub.DropTable, pb.DropTableRequest(name=name), retry=False).dropped_experiences


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    """Read a stream to its end (batches already on their way are dropped)."""
    while await call.read() is not grpc.aio.EOF:
        pass


def _get_result(reply: pb.GetReply) -> GetResult:
    return GetResult(trxp.decode(reply.payload), reply.missing_uids)


def _list_request(
    table: str,
    states: Iterable[str],
    min_model_version: int | None,
    max_model_version: int | None,
    after: int,
    limit: int,
) -> pb.ListExperiencesRequest:
    return pb.ListExperiencesRequest(
        table=table,
        states=list(states),
        min_model_version=min_model_version,
        max_model_version=max_model_version,
        after=after,
        limit=limit,
    )


def _page(reply: pb.ListExperiencesReply) -> ExperiencePage:
    def optional(msg: Any, name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    listed = [
        ListedExperience(
            e.uid, e.group_id, e.state, optional(e, "model_version"), optional(e, "reward"), e.times_sampled
        )
        for e in reply.experiences
    ]
    return ExperiencePage(listed, reply.next, reply.done)


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


class AsyncBufferClient(_Base):
    """asyncio client with the methods of BufferClient, as coroutines."""

    _insecure_channel = staticmethod(grpc.aio.insecure_channel)
    _secure_channel = staticmethod(grpc.aio.secure_channel)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncBufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self, method: Callable[..., Awaitable[T]], request: Any, *, retry: bool, timeout: float | None = None
    ) -> T:
        deadline = time.monotonic() + (timeout or self.timeout)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=max(0.001, deadline - time.monotonic()), metadata=self._metadata)
            except grpc.RpcError as exc:
                pause = self._retry_pause(exc, retry, attempt, deadline)
                if pause is None:
                    raise ExpbufError(exc.code(), exc.details() or "") from None
                attempt += 1
                await asyncio.sleep(pause)

    async def push(
        self, items: bytes | Iterable[Any], table: str = "default", *, timeout: float | None = None
    ) -> PushResult:
        """Store TRXP bytes or experiences (expbuf's or Trinity-RFT's) durably; durable when it returns."""
        request = pb.PushRequest(table=table, payload=_payload(items))
        return _push_result(await self._call(self._stub.Push, request, retry=True, timeout=timeout))

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
        window: int = 2,
    ) -> AsyncIterator[Batch]:
        """Stream batches as BufferClient.sample does; leased batches' ack()/nack() return coroutines."""
        request = _sample_request(
            table,
            batch_size,
            num_groups,
            order,
            delivery,
            lease_seconds,
            timeout,
            max_batches,
            min_model_version,
            allow_partial,
            trainer_version,
            window,
        )
        call = self._stub.Sample(metadata=self._metadata)
        received = 0
        try:
            await call.write(request)
            while (reply := await call.read()) is not grpc.aio.EOF:
                received += 1
                await call.write(_confirmation(received))
                yield _batch(reply, table, self.ack, self.nack, AsyncBatch)
        except grpc.RpcError as exc:
            raise ExpbufError(exc.code(), exc.details() or "") from None
        finally:
            if not call.done():  # the caller stopped early: end the stream cleanly
                with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
                    await call.write(_confirmation(received, stop=True))
                    await asyncio.wait_for(_drain(call), _STOP_SECONDS)
                call.cancel()

    async def ack(self, lease_id: str, table: str = "default") -> int:
        """Acknowledge a lease: its batch is consumed. Returns the experiences it held."""
        request = pb.AckRequest(table=table, lease_id=lease_id)
        return (await self._call(self._stub.Ack, request, retry=False)).acked

    async def nack(self, lease_id: str, table: str = "default") -> int:
        """Give a lease's batch back to the buffer now. Returns the experiences it held."""
        request = pb.NackRequest(table=table, lease_id=lease_id)
        return (await self._call(self._stub.Nack, request, retry=False)).requeued

    async def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell the table which policy version the trainer holds (it only moves forward; see reset_offpolicy).
        Returns the version stored."""
        request = _trainer_version_request(version, table)
        return (await self._call(self._stub.SetTrainerVersion, request, retry=True)).version

    async def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> dict[str, int]:
        """As BufferClient.reset_offpolicy."""
        request = _reset_request(table, trainer_version)
        return _reset_result(await self._call(self._stub.ResetOffPolicy, request, retry=True))

    async def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """How many of `count` rollouts may start now under the table's staleness bound (see BufferClient.admit)."""
        request = _admit_request(table, count, wait, grant_seconds)
        reply = await self._call(self._stub.Admit, request, retry=False, timeout=wait + self.timeout)
        return Grant(reply.granted, reply.grant_id, reply.expires_unix, table)

    async def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """Finish a grant: `accepted` rollouts stay counted, the others give their room back (all, if unset)."""
        return (await self._call(self._stub.FinishGrant, _finish_request(grant, accepted), retry=False)).returned

    async def get(self, uids: Iterable[str], table: str = "default") -> GetResult:
        """The stored experiences among uids, in request order; `.missing_uids` lists the others."""
        reply = await self._call(self._stub.Get, pb.GetRequest(table=table, uids=list(uids)), retry=True)
        return _get_result(reply)

    async def list_experiences(
        self,
        table: str = "default",
        *,
        states: Iterable[str] = (),
        min_model_version: int | None = None,
        max_model_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> ExperiencePage:
        """A page of the table's live experiences in insertion order (see BufferClient.list_experiences)."""
        request = _list_request(table, states, min_model_version, max_model_version, after, limit)
        return _page(await self._call(self._stub.ListExperiences, request, retry=True))

    async def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        """Remove experiences by uid and whole groups by id, with their records, so they may be pushed again
        (admin scope). Returns how many experiences were removed."""
        request = pb.DeleteRequest(table=table, uids=list(uids), group_ids=list(groups))
        return (await self._call(self._stub.Delete, request, retry=False)).deleted

    async def seal(self, group_id: str, table: str = "default") -> int:
        """Complete a pending group now, with the runs it has; its advantages are computed over them.
        Returns the group's size."""
        return (await self._call(self._stub.Seal, pb.SealRequest(table=table, group_id=group_id), retry=False)).size

    async def stats(self, table: str = "") -> dict[str, dict[str, Any]]:
        """Counts by state, bytes, groups, totals, trainer version and shaping counts of one table,
        or of every table when `table` is empty, keyed by table name::

            ready = client.stats("grpo8")["grpo8"]["ready"]
        """
        reply = await self._call(self._stub.Stats, pb.StatsRequest(table=table), retry=True)
        return {t.name: _fields(t) for t in reply.tables}

    async def server_info(self) -> dict[str, Any]:
        """The server's version, uptime, storage and map use, and the device advantages run on."""
        return _fields(await self._call(self._stub.ServerInfo, pb.ServerInfoRequest(), retry=True))

    async def create_table(self, name: str, *, exist_ok: bool = False, **settings: Any) -> dict[str, Any]:
        """Create a table; settings use the TOML names (group_by, group_size, estimator, capacity, ...)."""
        request = _create_table_request(name, exist_ok, settings)
        return wire.table_from_proto((await self._call(self._stub.CreateTable, request, retry=False)).config)

    async def list_tables(self) -> list[dict[str, Any]]:
        """Every table's settings, under the names of a TOML `[[tables]]` block."""
        reply = await self._call(self._stub.ListTables, pb.ListTablesRequest(), retry=True)
        return [wire.table_from_proto(t) for t in reply.tables]

    async def drop_table(self, name: str) -> int:
        """Drop a table with every experience, group, lease and counter in it (admin scope).
        Returns how many experiences it held."""
        return (await self._call(self._stub.DropTable, pb.DropTableRequest(name=name), retry=False)).dropped_experiences
