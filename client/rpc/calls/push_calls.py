"""A push as the clients make it (PushCalls, declared once: rpc/declare.py): what a push takes and
its payload (TRXP bytes, a ColumnBatch's, or experiences encoded), the Push or the PushStream of
chunks it is sent as, and its reply read. The pushers (pushers/, shards/) send the same payload
and messages over their streams."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from expbuf.proto.v1 import buffer_pb2 as pb

from ... import trxp
from ...results import PushResult
from ...schema.experience import EID
from ...trxp.column_batch import wire as column_wire
from ...trxp.column_batch.build import ColumnBatch
from .. import frames
from ..declare import Chunked, ClientSettings, Plan, Unary, declare

# What a push takes: TRXP bytes, a ColumnBatch, or experiences (expbuf's or Trinity-RFT's).
Items = bytes | ColumnBatch | Iterable[Any]


PUSH_TAKES = "push takes TRXP bytes, a ColumnBatch or a list of experiences (expbuf's Experience or Trinity-RFT's)"


def payload(items: Items) -> bytes:
    """TRXP bytes as they are, a ColumnBatch's payload, or experiences (expbuf's or Trinity-RFT's)
    encoded; anything else a TypeError saying what a push takes (the codec would fail on it
    deep inside, reading an `eid` a dict's key or a string's letter has not)."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        return bytes(items)
    if isinstance(items, ColumnBatch):
        return items.payload
    if hasattr(items, "eid"):
        raise TypeError(f"{PUSH_TAKES}, got one {type(items).__name__}: push a list of it ([experience])")
    if isinstance(items, (str, Mapping)) or not isinstance(items, Iterable):
        fields = " (a dict of fields goes in a ColumnBatch, or Experience(**fields))"
        raise TypeError(f"{PUSH_TAKES}, got {type(items).__name__}{fields if isinstance(items, Mapping) else ''}")
    experiences = list(items)
    for index, item in enumerate(experiences):
        if not hasattr(item, "eid"):
            raise TypeError(f"{PUSH_TAKES}; item {index} is a {type(item).__name__}, which has no eid")
    return trxp.encode(experiences)


def payload_uids(body: bytes) -> tuple[str, ...]:
    """The uids of a push's payload, TRXP or columns; TrxpError for one that is neither."""
    if column_wire.is_columns(body):
        return tuple(EID(**eid).uid for eid in column_wire.read(body).eids)
    return tuple(item.uid for item in trxp.parse(body))


def push(items: Items, table: str, timeout: float | None, chunk_bytes: int) -> Unary[PushResult] | Chunked[PushResult]:
    """One Push, or a PushStream of chunks of `chunk_bytes` for a payload larger (0: never): the
    call of PushCalls.push."""

    body = payload(items)
    if 0 < chunk_bytes < len(body):
        most = frames.most_push_request(chunk_bytes, table)
        return Chunked(lambda: push_requests(body, table, chunk_bytes), push_result, True, timeout, message_bytes=most)
    return Unary("Push", frames.push_request(body, table), push_result, retry=True, timeout=timeout)


def push_result(reply: pb.PushReply) -> PushResult:
    return PushResult(
        list(reply.stored_uids),
        list(reply.duplicate_uids),
        list(reply.completed_groups),
        list(reply.stale_uids),
        list(reply.partial_uids),
    )


def push_requests(body: bytes, table: str, size: int, seq: int = 0) -> Iterator[bytes]:
    """The PushStream messages of one push, serialised (frames.py): whole, or in chunks of `size`
    (0: whole) when larger, each copied once, from the payload into its message, each chunk after
    the first with its offset, so that a server that never got the chunks before it knows it."""
    if not 0 < size < len(body):
        yield frames.push_request(body, table, seq=seq)
        return
    view = memoryview(body)
    yield frames.push_request(view[:size], table, seq=seq, total_bytes=len(body))
    for start in range(size, len(body), size):
        yield frames.push_request(view[start : start + size], offset=start)


class PushCalls(ClientSettings):
    """A push, as the clients make it (rpc/declare.py)."""

    @declare(shards=lambda s: s._push)
    def push(self, items: Items, table: str = "default", *, timeout: float | None = None) -> Plan[PushResult]:
        """Store TRXP bytes, experiences (expbuf's or Trinity-RFT's) or a ColumnBatch; durable when it returns.
        A retried push is safe: what was stored already comes back in `duplicates`. A payload
        larger than the client's `push_chunk_bytes` goes in chunks over one PushStream. A full table
        in block mode makes it wait for room until its deadline, asking again while the server has
        as many calls waiting as it lets (calls.Attempts).

        Sharded: each group's part goes to the shard that owns it, the parts in parallel; a shard
        that failed raises ShardError, its `result` what the others stored."""
        return push(items, table, timeout, self.push_chunk_bytes)
