"""A PushRequest read by hand, its payload a view of the received bytes, not a copy.

A push's message arrives as one bytes object (gRPC copies it out of its own buffers once);
parsing it as a protobuf message and reading its payload field would copy it twice more, so
PushRequest is read here by hand and its payload is a view of those bytes. Decoding then packs
each experience once (the stored blob), the received bytes are let go, and LMDB copies the
blobs into its pages: a push holds about twice its payload at its peak, plus gRPC's copies of
its message while it is received. A message refused as it is read (push_memory.py) is a
`Refusal`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from expbuf.client.schema.reasons import Reason
from expbuf.client.trxp import varints

from ...store import Entry
from ..interceptors.base import CALL_TABLE, refuse


@dataclass(slots=True)
class PushMessage:
    """A PushRequest whose payload is a view of the received bytes (or of a payload put
    together from chunks)."""

    table: str
    payload: memoryview
    seq: int
    total_bytes: int = 0
    held: list[Callable[[], None]] = field(default_factory=list)  # what it holds of max_inflight_bytes
    entries: list[Entry] | None = None  # a push in chunks staged as it came: its experiences (ingest.Stager)
    wire_bytes: int = 0  # the size of the message it was read from, which its call's declaration bounds
    offset: int = 0  # a chunk after a push's first: where it starts in the payload (0: unset)

    def drop_payload(self) -> None:
        """Let the received bytes go (once decoded), before the store copies the packed experiences."""
        self.payload = memoryview(b"")

    def release(self) -> None:
        """Give back what the push held of max_inflight_bytes (once stored or refused; again: nothing)."""
        _release(self.held)


class Refusal(Exception):
    """A PushStream message refused as it was read: the status the stream ends with in its turn."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: Reason, *, busy: bool = False) -> None:
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason
        self.busy = busy  # it did nothing: the same push later may get in (wire.BUSY)
        self.table = ""  # the table its message named, where it was read on another thread than the call's

    def abort(self, context: grpc.ServicerContext) -> NoReturn:
        if self.table:
            CALL_TABLE.set(self.table)  # the call's refusal is counted against it (interceptors/metrics.py)
        refuse(context, self.code, self.details, self.reason, self.busy)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    read = varints.read(data, pos)
    if read is None:
        raise ValueError("PushRequest: a truncated or overlong varint")
    return read


def read_push_request(data: bytes) -> PushMessage:
    """PushRequest's wire form (table = 1, payload = 2, seq = 3, total_bytes = 4, offset = 5; other
    fields skipped, the last of a repeated field wins, as protobuf reads them), the payload uncopied."""
    view = memoryview(data)
    table, payload, seq, total, offset = b"", view[:0], 0, 0, 0
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _varint(data, pos)
            if number == 3:
                seq = value
            elif number == 4:
                total = value
            elif number == 5:
                offset = value
        elif kind == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ValueError("PushRequest: a field runs past the end of the message")
            if number == 1:
                table = data[pos : pos + length]
            elif number == 2:
                payload = view[pos : pos + length]
            pos += length
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise ValueError(f"PushRequest: field {number} has wire type {kind}, which no field of it has")
        if number == 0 or pos > len(data):
            raise ValueError("PushRequest: malformed message")
    return PushMessage(table.decode(), payload, seq, total, wire_bytes=len(data), offset=offset)


def _release(held: list[Callable[[], None]]) -> None:
    """Call each of `held` (the last first), every one of them even where one before it raised (a
    staged push's drop refused by the store must not keep its max_inflight_bytes); then raise the
    first that raised."""
    failed: BaseException | None = None
    while held:
        try:
            held.pop()()
        except BaseException as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
