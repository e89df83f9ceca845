"""What both clients of one server share below their calls: TLS settings, the channel, and when to retry.

A push is idempotent on the server (a retried payload is reported as duplicates), so pushes
and reads are retried with backoff while the server is UNAVAILABLE; every call has a deadline.
The blocking client (client.py) and the asyncio one (aio.py) differ only in how they wait.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import grpc

from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from .errors import ExpbufError
from .sample_reply import sample_method

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# A push larger than this goes over PushStream in chunks of this size (see PushRequest.total_bytes).
DEFAULT_PUSH_CHUNK_BYTES = 4 << 20
DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRIES = 5
# A server that restarts is reached again within about 2 s: gRPC's own reconnect backoff grows
# to 120 s, which would keep a restarted server (or shard) unused that long after it is back.
RECONNECT = (
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


class ChannelOptions(TypedDict, total=False):
    """A client's keywords after target, token and tls (see ClientBase), as the sharded clients take them."""

    timeout: float
    retries: int
    max_message_bytes: int
    push_chunk_bytes: int


# What a plaintext client's error adds where gRPC says only that the server closed the connection.
TLS_HINT = (
    "if the server takes TLS only, give the client its CA: tls=Tls(root_certificates=CA_PEM), or tls=True for the"
    " system's CAs; expbuf's commands take --tls-ca or EXPBUF_TLS_CA"
)


def call_error(exc: grpc.RpcError, tls: bool) -> ExpbufError:
    """The ExpbufError of a failed call, with gRPC's details. A TLS server closes a plaintext
    connection, which gRPC reports as UNAVAILABLE "Socket closed": a plaintext client adds the hint."""
    details = exc.details() or ""
    if not tls and exc.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details:
        details = f"{details} ({TLS_HINT})"
    return ExpbufError(exc.code(), details)


def backoff(attempt: int) -> float:
    """Seconds to wait before retry `attempt` + 1 of a call the server could not take: doubling
    from 50 ms up to 2 s, with jitter, so that clients that lost one server do not return at once."""
    return min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())


class Attempts:
    """One call's attempts under one deadline: how long the next may take, and the pause before it."""

    def __init__(self, retries: int, retry: bool, seconds: float, *, tls: bool) -> None:
        self._tls = tls
        self._retries = retries if retry else 0
        self._deadline = time.monotonic() + seconds
        self._attempt = 0

    def remaining(self) -> float:
        """The deadline left for the next attempt."""
        return max(0.001, self._deadline - time.monotonic())

    def pause(self, exc: grpc.RpcError) -> float:
        """Seconds to wait before retrying a call the server could not take now; raises the
        call's ExpbufError when it is not to be retried (not UNAVAILABLE, no retries or time left)."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and self._attempt < self._retries:
            pause = backoff(self._attempt)
            if time.monotonic() + pause < self._deadline:
                self._attempt += 1
                return pause
        raise call_error(exc, self._tls) from None


class ClientBase:
    """Settings and channel shared by the blocking and the asyncio client."""

    _insecure_channel: Callable[..., Any]
    _secure_channel: Callable[..., Any]

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        token: str | None = None,
        tls: Tls | bool | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        push_chunk_bytes: int = DEFAULT_PUSH_CHUNK_BYTES,
    ) -> None:
        """Connect to `target` (HOST:PORT). `token` is sent as a bearer token; `tls` is a Tls
        (a CA, and a client pair for mutual TLS) or True for the system's CAs. Every call has a
        deadline of `timeout` seconds; pushes and reads are retried up to `retries` times while
        the server is UNAVAILABLE (safe: a push is idempotent). `max_message_bytes` must be at
        least the server's to receive its largest batches. A push larger than `push_chunk_bytes`
        is sent in chunks of that size, so that neither side holds gRPC's copies of one large
        message (0: every push in one message, as a server of 0.2.0 or older needs). The channel opens lazily::

            with BufferClient("127.0.0.1:50051", token=os.environ["EXPBUF_TOKEN"]) as client:
                client.push(experiences, table="grpo8")
        """
        if push_chunk_bytes != 0 and not 1 << 16 <= push_chunk_bytes <= max_message_bytes:
            raise ValueError(
                f"push_chunk_bytes must be 0 (no chunks) or from 65536 to max_message_bytes = {max_message_bytes}, "
                f"got {push_chunk_bytes}"
            )
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self.push_chunk_bytes = push_chunk_bytes
        self.max_message_bytes = max_message_bytes
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            *RECONNECT,
        ]
        self._tls = bool(tls)
        if tls:
            credentials = (tls if isinstance(tls, Tls) else Tls()).credentials()
            self._channel = type(self)._secure_channel(target, credentials, options=options)
        else:
            self._channel = type(self)._insecure_channel(target, options=options)
        self._stub = pb_grpc.ExperienceBufferStub(self._channel)
        self._sample = sample_method(self._channel)  # replies read with one copy of their payload

    def _attempts(self, retry: bool, timeout: float | None) -> Attempts:
        return Attempts(self.retries, retry, timeout or self.timeout, tls=self._tls)
