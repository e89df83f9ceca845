"""How a grpc.aio stream ended: the status its server, a proxy, or the lost connection gave it.

When a write fails because its stream has ended (the server refused a push, or went away, or a
proxy ended the stream, while the client was still writing), grpc.aio gives the call the status
INTERNAL "Internal error from Core" in place of the stream's own (grpc/grpc#36066, grpcio 1.85).
If the event loop comes to the failed write after the stream's status, that INTERNAL replaces
the status for good; if before, the stream's status replaces it when it comes. A read of the
stream, or `await call.code()`, gets whichever the call holds at that moment. So the asyncio
pusher failed with INTERNAL a push that the stream's UNAVAILABLE would have sent again, or a
refused push that its refusal names; the blocking client reads the stream's own status.

The asyncio client therefore reads how its streams ended here, never from the exception a read
or a write raised: the call's first status and its trailing metadata (which say whether a refusal
did nothing, wire.BUSY, and which the failed write's INTERNAL takes away too), taken as they are
set (its done callbacks run then),
unless that one is the failed write's; then the status that replaces it, or UNAVAILABLE if none
does within REPLACED_WITHIN (the stream ended under a write and grpc.aio kept no status of its own). Only grpc.aio gives
INTERNAL with those details; a server's own INTERNAL is the stream's status like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import grpc.aio

T = TypeVar("T")
Status = tuple[grpc.StatusCode, str]

WRITE_FAILED: Status = (grpc.StatusCode.INTERNAL, "Internal error from Core")
# How long the stream's own status may take to replace a failed write's: Core delivers both at
# once, so it is there within a turn or two of the event loop; this bounds the wait for a call
# whose INTERNAL nothing replaces.
REPLACED_WITHIN = 1.0
# What a stream ended with when grpc.aio kept no status but the failed write's: it ended while the
# client wrote to it, which a server's refusal or its going away both do. UNAVAILABLE, so the
# pusher sends its unanswered pushes again on a new stream: safe, a push stores nothing twice,
# and a refusal answers the push again there, this time with its own status.
NO_STATUS: Status = (
    grpc.StatusCode.UNAVAILABLE,
    "the stream ended while the client was writing to it and grpc.aio kept no status for it (grpc/grpc#36066)",
)
LOOK_EVERY = 0.005


def _at_once(step: Coroutine[Any, Any, T]) -> T | None:
    """What a coroutine returns if it returns without waiting, else None: a done call's code()
    and details() do, so a done callback reads the status the call holds as it runs."""
    try:
        step.send(None)
    except StopIteration as returned:
        return returned.value
    step.close()
    return None


class StreamStatus:
    """How one grpc.aio stream ended. Made with the call, before anything is written on it."""

    def __init__(self, call: grpc.aio.Call) -> None:
        self._call = call
        self._first: Status | None = None
        self._first_trailing: grpc.aio.Metadata | None = None  # its trailing metadata, which goes with it
        call.add_done_callback(self._set)

    def _set(self, call: grpc.aio.Call) -> None:
        """The call's first status, as it is set: a failed write's INTERNAL may replace it after."""
        code, details = _at_once(call.code()), _at_once(call.details())
        if code is not None:
            self._first = code, details or ""
            self._first_trailing = _at_once(call.trailing_metadata())

    async def _held(self) -> Status:
        return await self._call.code(), await self._call.details() or ""

    async def status(self) -> Status:
        """The stream's own code and details, once it has ended."""
        held = await self._held()
        if self._first is not None and self._first != WRITE_FAILED:
            return self._first
        loop = asyncio.get_running_loop()
        until = loop.time() + REPLACED_WITHIN
        while held == WRITE_FAILED and loop.time() < until:
            await asyncio.sleep(LOOK_EVERY)
            held = await self._held()
        if held == WRITE_FAILED:  # nothing replaced it: the stream ended under a write, its status lost
            return NO_STATUS
        return held

    async def error(self) -> grpc.aio.AioRpcError | None:
        """The error of the stream's own status once it has ended, with the stream's trailing
        metadata (what says a refusal did nothing: wire.BUSY); None if it ended OK."""
        code, details = await self.status()
        if code == grpc.StatusCode.OK:
            return None
        trailing = self._first_trailing if (code, details) == self._first else await self._call.trailing_metadata()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


async def replies(
    call: grpc.aio.StreamStreamCall | grpc.aio.UnaryStreamCall, keep: Callable[[Any], Any | None] = lambda reply: reply
) -> list[Any]:
    """Every reply of a stream whose requests gRPC writes from an iterator (a push in chunks) or
    of a server's stream (ReadFields), as `keep` makes it (None: none yet, a reply in parts);
    raises the error of the stream's own status."""
    status = StreamStatus(call)
    read: list[Any] = []
    with contextlib.suppress(grpc.RpcError):  # how it ended is read below
        async for reply in call:
            if (made := keep(reply)) is not None:
                read.append(made)
    error = await status.error()
    if error is not None:
        raise error
    return read
