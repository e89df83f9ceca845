"""What each call of the service sends and how its reply is read, for the blocking and the asyncio client.

A unary call is described once here as a `Unary`: the stub method, the request, whether a
retry is safe, and how the reply becomes the client's result. BufferClient (client.py) and
AsyncBufferClient (aio.py) only run the description, one blocking and one awaiting. The
Sample stream's pieces (confirmations, batches) are here too; its two loops are each client's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from . import trxp, wire
from .errors import ExpbufError
from .results import (
    Batch,
    BufferStats,
    ExperiencePage,
    GetResult,
    Grant,
    ListedExperience,
    PushResult,
    ServerInfo,
    TableInfo,
    TableStats,
)
from .sample_reply import SampleReplyParts

R = TypeVar("R")
# How long a stream the caller left may take to hand back the batches already on their way.
STOP_SECONDS = 5.0


@dataclass(frozen=True)
class Unary(Generic[R]):
    """One unary call: `method` of the stub with `request`; `read` turns the reply into the result.

    `retry` says whether the call may be made again after UNAVAILABLE (it is idempotent);
    `timeout` replaces the client's deadline for this call.
    """

    method: str
    request: Any
    read: Callable[[Any], R]
    retry: bool
    timeout: float | None = None


@dataclass(frozen=True)
class Chunked(Generic[R]):
    """A push sent in chunks over PushStream (PushRequest.total_bytes): `requests()` makes its
    messages as gRPC sends them, anew for each attempt; the stream's one reply is read as a Unary's."""

    requests: Callable[[], Iterator[pb.PushRequest]]
    read: Callable[[Any], R]
    retry: bool
    timeout: float | None = None
    method: str = "PushStream"


def one_reply(replies: list[Any]) -> Any:
    """The reply to a push sent in chunks: its stream answers it once."""
    if len(replies) != 1:
        raise ExpbufError(grpc.StatusCode.INTERNAL, f"PushStream answered a push in chunks {len(replies)} times")
    return replies[0]


def payload(items: bytes | Iterable[Any]) -> bytes:
    """TRXP bytes as they are, or experiences (expbuf's or Trinity-RFT's) encoded."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        return bytes(items)
    return trxp.encode(items)


def _version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    return version


def push(
    items: bytes | Iterable[Any], table: str, timeout: float | None, chunk_bytes: int
) -> Unary[PushResult] | Chunked[PushResult]:
    """One Push, or a PushStream of chunks of `chunk_bytes` for a payload larger (0: never)."""

    def read(reply: pb.PushReply) -> PushResult:
        return PushResult(
            list(reply.stored_uids), list(reply.duplicate_uids), list(reply.completed_groups), list(reply.stale_uids)
        )

    body = payload(items)
    if 0 < chunk_bytes < len(body):
        return Chunked(lambda: _chunks(body, table, chunk_bytes), read, retry=True, timeout=timeout)
    return Unary("Push", pb.PushRequest(table=table, payload=body), read, retry=True, timeout=timeout)


def _chunks(body: bytes, table: str, size: int) -> Iterator[pb.PushRequest]:
    yield pb.PushRequest(table=table, payload=body[:size], total_bytes=len(body))
    for start in range(size, len(body), size):
        yield pb.PushRequest(payload=body[start : start + size])


def ack(lease_id: str, table: str) -> Unary[int]:
    return Unary("Ack", pb.AckRequest(table=table, lease_id=lease_id), lambda r: r.acked, retry=False)


def nack(lease_id: str, table: str) -> Unary[int]:
    return Unary("Nack", pb.NackRequest(table=table, lease_id=lease_id), lambda r: r.requeued, retry=False)


def set_trainer_version(version: int, table: str) -> Unary[int]:
    request = pb.SetTrainerVersionRequest(table=table, version=_version(version))
    return Unary("SetTrainerVersion", request, lambda r: r.version, retry=True)


def reset_offpolicy(table: str, trainer_version: int | None) -> Unary[dict[str, int]]:
    if trainer_version is None:
        request = pb.ResetOffPolicyRequest(table=table)
    else:
        request = pb.ResetOffPolicyRequest(
            table=table, trainer_version=_version(trainer_version), has_trainer_version=True
        )
    return Unary(
        "ResetOffPolicy",
        request,
        lambda r: {"trainer_version": r.trainer_version, "submitted": r.submitted},
        retry=True,
    )


def writers(table: str, change: int) -> Unary[tuple[int, bool]]:
    request = pb.WritersRequest(table=table, change=change)
    return Unary("Writers", request, lambda r: (r.open, r.done), retry=change == 0)


def admit(table: str, count: int, wait: float, grant_seconds: float, timeout: float) -> Unary[Grant]:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    request = pb.AdmitRequest(table=table, count=count, wait_seconds=wait, grant_seconds=grant_seconds)
    return Unary(
        "Admit",
        request,
        lambda r: Grant(r.granted, r.grant_id, r.expires_unix, table),
        retry=False,
        timeout=wait + timeout,
    )


def finish_grant(grant: Grant, accepted: int | None) -> Unary[int]:
    request = pb.FinishGrantRequest(table=grant.table, grant_id=grant.grant_id, accepted=accepted)
    return Unary("FinishGrant", request, lambda r: r.returned, retry=False)


def get(uids: Iterable[str], table: str) -> Unary[GetResult]:
    request = pb.GetRequest(table=table, uids=list(uids))
    return Unary("Get", request, lambda r: GetResult(trxp.decode_reply(r.payload), r.missing_uids), retry=True)


class ListFilters(TypedDict, total=False):
    """The keywords of `list_experiences()` after the table: which experiences, and the page."""

    states: Iterable[str]
    min_model_version: int | None
    max_model_version: int | None
    after: int
    limit: int


def list_experiences(
    table: str,
    *,
    states: Iterable[str] = (),
    min_model_version: int | None = None,
    max_model_version: int | None = None,
    after: int = 0,
    limit: int = 1000,
) -> Unary[ExperiencePage]:
    """Of the table's live experiences in insertion order, those of `states` (all when empty) and of
    model versions in the range given, a page of up to `limit` after position `after`."""

    def optional(msg: Any, name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    def read(reply: pb.ListExperiencesReply) -> ExperiencePage:
        listed = [
            ListedExperience(
                e.uid, e.group_id, e.state, optional(e, "model_version"), optional(e, "reward"), e.times_sampled
            )
            for e in reply.experiences
        ]
        return ExperiencePage(listed, reply.next, reply.done)

    request = pb.ListExperiencesRequest(
        table=table,
        states=list(states),
        min_model_version=min_model_version,
        max_model_version=max_model_version,
        after=after,
        limit=limit,
    )
    return Unary("ListExperiences", request, read, retry=True)


def delete(uids: Iterable[str], table: str, groups: Iterable[str]) -> Unary[int]:
    request = pb.DeleteRequest(table=table, uids=list(uids), group_ids=list(groups))
    return Unary("Delete", request, lambda r: r.deleted, retry=False)


def seal(group_id: str, table: str) -> Unary[int]:
    return Unary("Seal", pb.SealRequest(table=table, group_id=group_id), lambda r: r.size, retry=False)


def stats(table: str) -> Unary[BufferStats]:
    def read(reply: pb.StatsReply) -> BufferStats:
        return BufferStats({t.name: TableStats.from_proto(t) for t in reply.tables})

    return Unary("Stats", pb.StatsRequest(table=table), read, retry=True)


def server_info() -> Unary[ServerInfo]:
    return Unary("ServerInfo", pb.ServerInfoRequest(), ServerInfo.from_proto, retry=True)


def _table_info(reply: pb.CreateTableReply) -> TableInfo:
    return TableInfo.from_settings(wire.table_from_proto(reply.config))


def create_table(name: str, exist_ok: bool, settings: dict[str, Any]) -> Unary[TableInfo]:
    settings = dict(settings)
    capacity = settings.pop("capacity", None)
    if capacity is not None:
        settings["capacity_experiences"] = capacity
    request = pb.CreateTableRequest(config=wire.table_to_proto({"name": name, **settings}), exist_ok=exist_ok)
    return Unary("CreateTable", request, _table_info, retry=False)


def list_tables() -> Unary[list[TableInfo]]:
    def read(reply: pb.ListTablesReply) -> list[TableInfo]:
        return [TableInfo.from_settings(wire.table_from_proto(t)) for t in reply.tables]

    return Unary("ListTables", pb.ListTablesRequest(), read, retry=True)


def drop_table(name: str) -> Unary[int]:
    return Unary("DropTable", pb.DropTableRequest(name=name), lambda r: r.dropped_experiences, retry=False)


# ---- the Sample stream ----------------------------------------------------------------------


def confirmation(received: int, *, stop: bool = False) -> pb.SampleRequest:
    """Tells the server that `received` batches arrived, which frees room in the window for
    more (or, with `stop`, asks for nothing more: batches already on their way return to
    the buffer)."""
    return pb.SampleRequest(received=received, stop=stop)


def batch(reply: SampleReplyParts, table: str, ack: Callable, nack: Callable, kind: type[Batch] = Batch) -> Batch:
    """A sampled batch that acknowledges through `ack` and `nack` (the client's)."""
    rest = reply.rest
    return kind(
        payload=trxp.attach_advantages(reply.payload, rest.advantages, rest.response_lengths),
        uids=list(rest.uids),
        group_ids=list(rest.group_ids),
        lease_id=rest.lease_id,
        lease_expires=rest.lease_expires_unix,
        partial=rest.partial,
        table=table,
        times_sampled=list(rest.times_sampled),
        _ack=ack,
        _nack=nack,
    )
