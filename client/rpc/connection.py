"""What both clients of one server share below their calls: TLS settings, the channels, and their retry policy.

A push is idempotent on the server (a retried payload is reported as duplicates), so pushes
and reads are retried by gRPC's own retry policy (the channel's service config) while the
server is UNAVAILABLE; every call has a deadline that covers all its attempts. gRPC has no
switch for one call: a call of a method under the policy that must not be made twice (calls/)
goes over a second channel without it. A push in chunks goes over a third, without gRPC's
retries at all, and the client makes it again itself (calls.Attempts): gRPC's replay of a
stream's messages can leave one of them unsent. The blocking client (client.py) and the asyncio
one (aio.py) differ only in how they wait.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self, TypedDict, cast

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from ..errors import ExpbufError
from ..schema.tokens import bearer_token
from .frames import most_push_request
from .sample_reply import PARTS_METHODS, parts_method, sample_method
from .wire import BUSY, LEAST_CHUNK_BYTES, MESSAGE_BYTES, reason_of


class CallShape(Protocol):
    """What the channel needs to know of a call (declare.Unary, declare.Chunked) to make it."""

    @property
    def method(self) -> str: ...

    @property
    def retry(self) -> bool: ...

    @property
    def timeout(self) -> float | None: ...

    @property
    def message_bytes(self) -> int | None: ...


DEFAULT_PORT = 50051
DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# A push larger than this goes over PushStream in chunks of this size (see PushRequest.total_bytes).
DEFAULT_PUSH_CHUNK_BYTES = 4 << 20
# What a chunk's PushRequest holds beside its bytes, at most: the longest table name, its numbers
# and the bytes' length (of a chunk under 4 GiB).
CHUNK_ENVELOPE = most_push_request(1 << 32, "t" * 64) - (1 << 32)
DEFAULT_TIMEOUT = 30.0
# gRPC makes at most 5 attempts of a call (its retry design caps a policy's maxAttempts there,
# and grpcio has no setting to raise it): 4 retries after the first.
MAX_RETRIES = 4
DEFAULT_RETRIES = MAX_RETRIES
SERVICE = "expbuf.v1.ExperienceBuffer"
# The methods under the retry policy: every call of them is idempotent (an Admit names its grant,
# so that made again it answers the same one, as a Claim names its id; an Ack, a Nack or a
# FinishGrant made again answers as the one that ended its lease or grant did, the server
# remembering the leases and grants it saw end: those, wire.REPEATS_ANSWERED, only to a server that
# says it answers them again, calls/repeats.py), or is sent with the policy only when it is (a
# call of one whose `retry` is False, calls/, goes over the channel without it). Not here: Sample
# (a trainer's stream that breaks raises its error, as it always has), nor any call whose
# repetition would act twice (Delete, Seal, CreateTable, DropTable), nor PushStream: gRPC's retry
# filter replays a stream's messages sent before its retry, and reports a message the caller sends
# meanwhile as sent when a replayed one is (it tells them apart by kind only), so that message
# never goes: the server gets the push cut short. A push in chunks is made again by the client,
# whole (calls.Attempts).
LEASE_ENDS = frozenset({"Ack", "Nack", "Renew"})  # a batch's own calls on its lease
CLOSED_BEFORE = "%s on a closed client: close() was called before it"  # a call made after close(), by its name
RETRIED_METHODS = frozenset(
    {
        "Push",
        "Admit",
        "FinishGrant",
        "Claim",
        "Ack",
        "Nack",
        "Retire",
        "Renew",
        "SetTrainerVersion",
        "ResetOffPolicy",
        "Writers",
        "Get",
        "ReadFields",
        "GetPartials",
        "ReadPartials",
        "ListExperiences",
        "Stats",
        "ServerInfo",
        "ListTables",
        "CreateDataset",
        "ListDatasets",
        "RenewClaims",
        "ReleaseClaims",
        "ReportPrompts",
        "ListPrompts",
        "PutValues",
        "GetValues",
        "ClearValues",
    }
)
# The methods whose requests the client writes by hand (frames.py): their stubs take those bytes as
# they are. Each: its kind of call, and its reply's message.
FRAMED_METHODS: dict[str, tuple[str, Any]] = {
    "Push": ("unary_unary", pb.PushReply),
    "PushStream": ("stream_stream", pb.PushReply),
    "PutValues": ("unary_unary", pb.PutValuesReply),
}
# A server that restarts is reached again within 1.2 s (the most, with gRPC's jitter of 20%): gRPC's
# own reconnect backoff grows to 120 s, which would keep a restarted server (or shard) unused that
# long after it is back. BACKOFF's four retries span longer (1.5 s at least), so that a call made
# as the server comes back is retried past the next reconnect, not failed in its pause.
RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# A connection that goes silent while a call is open (its server's host lost, a network cut, a NAT
# that forgot it: nothing says it closed) is found by pinging it every 20 s and closing it when a
# ping goes 10 s unanswered: its calls fail UNAVAILABLE. A Sample stream, which has no deadline,
# waited for it forever. The server takes pings that far apart (server/app.PINGS_APART_MS); one
# before it ends a stream that waits a minute for data after the third ping (gRPC's default).
KEEPALIVE_MS = 20_000
KEEPALIVE = (
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what grpcio waits for a ping's answer (60 s unless told)
    ("grpc.http2.max_pings_without_data", 0),  # gRPC stops at 2 pings the server sends nothing between
)
# gRPC keeps what a call sent until the call is answered, so that a retry can send it again;
# past this many bytes it commits the call to its attempt, unretried. Its default (256 KiB)
# would leave every larger push unretried: with the most it takes, a push sent whole is retried
# whatever its size, and gRPC holds a copy of it until it is answered (a push in chunks goes
# over a channel without retries, where gRPC keeps none: ClientBase._chunks_channel).
RETRY_BUFFER = (("grpc.per_rpc_retry_buffer_size", 2**31 - 1),)


@dataclass(frozen=True)
class Backoff:
    """The pauses between attempts of a call: from `initial` seconds, times `multiplier` each
    time up to `most`, each ±`jitter` (gRPC's retry policy applies them, with its own jitter of ±20%)."""

    initial: float = 0.125
    most: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def pause(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` + 2 (0: before the second attempt)."""
        grown = self.initial * self.multiplier ** min(attempt, 64)  # `most` long before, and no overflow
        return min(self.most, grown) * random.uniform(1 - self.jitter, 1 + self.jitter)


BACKOFF = Backoff()


def checked_token(token: str | None) -> str | None:
    """`token` as its server reads it (schema/tokens.bearer_token): gRPC refused one ending in a
    newline as "INTERNAL: Invalid metadata", with a log of its own."""
    return None if token is None else bearer_token(token)


def service_config(retries: int) -> str:
    """The channel's service config: RETRIED_METHODS retried on UNAVAILABLE up to `retries`
    times (none: no policy), with the pauses of BACKOFF; and on CANCELLED, which a server answers
    to a call that arrives as its stop begins, before any of it ran (gRPC never retries a call its
    own client cancelled)."""
    if retries <= 0:
        return json.dumps({"methodConfig": []})
    policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": f"{BACKOFF.initial:g}s",
        "maxBackoff": f"{BACKOFF.most:g}s",
        "backoffMultiplier": BACKOFF.multiplier,
        "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
    }
    names = [{"service": SERVICE, "method": method} for method in sorted(RETRIED_METHODS)]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


# Each PEM setting of Tls in grpc.ssl_channel_credentials' order: what it holds, and its block.
_PEM_BLOCKS = {
    "root_certificates": ("certificate", re.compile(rb"-----BEGIN (TRUSTED )?CERTIFICATE-----")),
    "private_key": ("private key", re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    "certificate_chain": ("certificate", re.compile(rb"-----BEGIN (TRUSTED )?CERTIFICATE-----")),
}


@dataclass(frozen=True)
class Tls:
    """TLS settings: server CA (None = system roots) and, for mutual TLS, a client pair."""

    root_certificates: str | bytes | None = None
    certificate_chain: str | bytes | None = None
    private_key: str | bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: each setting a path to a PEM file, or the PEM bytes. One that
        holds no PEM block of its kind (a key given as the CA) is a ValueError naming it: gRPC failed
        each call "to create security handshaker", beside a log of its own."""
        pems = []
        for name, (kind, block) in _PEM_BLOCKS.items():
            value = getattr(self, name)
            pem = Path(value).read_bytes() if isinstance(value, str) else value
            if pem is not None and not block.search(pem):
                where = f" ({value})" if isinstance(value, str) else ""
                raise ValueError(f"Tls {name}{where} holds no PEM {kind} (a -----BEGIN ...{kind.upper()}----- block)")
            pems.append(pem)
        return grpc.ssl_channel_credentials(*pems)


class ChannelOptions(TypedDict, total=False):
    """A client's keywords after target, token and tls (see ClientBase), as the sharded clients take them."""

    timeout: float
    retries: int
    wait_for_ready: bool
    max_message_bytes: int
    push_chunk_bytes: int


# What a plaintext client's error adds where gRPC says only that the server closed the connection.
TLS_HINT = (
    "if the server takes TLS only, give the client its CA: tls=Tls(root_certificates=CA_PEM), or tls=True for the"
    " system's CAs; expbuf's commands take --tls-ca or EXPBUF_TLS_CA"
)
# What a TLS client without a certificate of its own adds there: the server may ask for one (client_ca in its [tls]).
MUTUAL_TLS_HINT = (
    "if the server asks for client certificates (mutual TLS), give the client its certificate and key:"
    " Tls(CA_PEM, certificate_chain=CERT_PEM, private_key=KEY_PEM); expbuf's commands take --tls-cert and --tls-key"
    " or EXPBUF_TLS_CLIENT_CERT and EXPBUF_TLS_CLIENT_KEY"
)
# gRPC's own details for a call whose deadline passed in the client (a server's refusal has its own words).
GRPC_DEADLINE = "Deadline Exceeded"
# What gRPC says of a server that answered in HTTP/1 (expbuf's metrics port, a web server): no HTTP/2 frame.
HTTP1_ANSWERS = ("Failed parsing HTTP/2", "Trying to connect an http1.x server")
# gRPC's refusal of a message past the server's max_message_bytes (not "CLIENT:", a reply past the
# client's own): the size sent, and the server's limit.
TOO_LARGE_FOR_SERVER = re.compile(r"SERVER: Received message larger than max \((\d+) vs\. (\d+)\)")
# URL schemes a target is written with by mistake: gRPC would resolve "http://host:port" as a host name.
URL_SCHEMES = ("http", "https", "grpc", "grpcs")
# gRPC's own schemes of a target that is no host (a socket's path, an address list): taken as they are.
ADDRESS_SCHEMES = ("unix", "unix-abstract", "vsock", "ipv4", "ipv6")
# HOST[:PORT] or [IPV6][:PORT], alone or after `dns:` and an optional `//AUTHORITY/`.
_HOST_PORT = re.compile(r"(?:dns:(?://[^/]*/)?)?(?P<host>\[[^\]]*\]|[^:/\[\]]+)(?::(?P<port>[^:/]*))?")


def checked_target(target: str) -> str:
    """`target` as both clients pass it to gRPC, or a ValueError saying what to change: gRPC takes a
    host without a port as port 443, and a URL's scheme as part of a host name, and says only
    that it cannot connect or resolve. One that is not a str is a TypeError (an AttributeError from
    inside, for a (host, port) tuple)."""
    if not isinstance(target, str):
        raise TypeError(f"target must be a 'HOST:PORT' str, got {type(target).__name__} {target!r:.60}")
    scheme, sep, rest = target.partition("://")
    if sep and scheme.lower() in URL_SCHEMES:
        raise ValueError(
            f"target {target!r} is a URL: drop the scheme: {rest.rstrip('/')!r} (a client takes HOST:PORT; "
            "TLS is the client's tls=Tls(...), not https)"
        )
    if sep and scheme == "expbuf":
        raise ValueError(
            f"target {target!r} is a buffer's location, which the framework adapters read: a client takes HOST:PORT"
            f" ({rest.partition('/')[0]!r})"
        )
    named = _HOST_PORT.fullmatch(target)
    if named is None or named["host"] in ADDRESS_SCHEMES:
        return target
    port = named["port"]
    if not port or not port.isdigit():
        host = named["host"]
        raise ValueError(
            f"target {target!r} has no port"
            + (f" (its port {port!r} is not a number)" if port else "")
            + f": gRPC would connect to port 443; add the server's, e.g. {host}:{DEFAULT_PORT} (expbuf's default)"
        )
    return target


# What gRPC's UNAVAILABLE says of a connection it could not make (its handshake closed, refused).
CONNECT_FAILED = "failed to connect to all addresses"


def tls_hint(tls: Tls | None) -> str:
    """Why a server might close this client's connections: TLS it has not, or a certificate it has not."""
    if tls is None:
        return TLS_HINT
    return MUTUAL_TLS_HINT if tls.certificate_chain is None else ""


def call_error(exc: grpc.RpcError, tls: Tls | None, target: str = "", waited: bool = False) -> ExpbufError:
    """The ExpbufError of a failed call to `target`, with gRPC's details and what the client can tell
    (and `busy` where the server says so, wire.BUSY), and the reason the server gave a refusal.

    A server closes a connection whose TLS it does not take (a plaintext client of a TLS server, a
    client without a certificate where mutual TLS asks for one), which gRPC reports as UNAVAILABLE
    "Socket closed" on a connection it never made: the error adds the hint. Not to a call whose
    connection was made (a server killed or restarted under it: "Stream removed (Socket closed)").
    A call that `waited` for the server (wait_for_ready)
    and reached none waits out its deadline, and gRPC says only "Deadline Exceeded": the error
    names the target and what keeps a client from it."""
    details, hint = exc.details() or "", tls_hint(tls)
    never_made = "Socket closed" in details and CONNECT_FAILED in details  # one made: its TLS was taken
    if exc.code() == grpc.StatusCode.UNAVAILABLE and any(answer in details for answer in HTTP1_ANSWERS):
        details = (
            f"{details} ({target} answered in HTTP/1, not gRPC: it is not an expbuf gRPC server; expbuf's metrics"
            f" port answers so, and its gRPC port is {DEFAULT_PORT} unless `expbuf serve --port` says another)"
        )
    elif exc.code() == grpc.StatusCode.UNAVAILABLE and never_made and hint:
        details = f"{details} ({hint})"
    elif exc.code() == grpc.StatusCode.UNAVAILABLE and "Too many pings" in details:
        details = (
            f"{details} ({target} predates the keepalive pings of this client, every"
            f" {KEEPALIVE_MS // 1000} s on an open call, and ended the connection for them: upgrade the"
            " server to this client's release, servers before clients)"
        )
    elif exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = past_the_servers_limit(details, target)
    elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and waited and details == GRPC_DEADLINE:
        details = (
            f"{details}: no answer from {target} in time; with wait_for_ready a call waits until its deadline for a"
            " server it cannot reach (none listening there, or one that refuses this client's TLS settings"
            f"{': ' + hint if hint else ''})"
        )
    trailing = exc.trailing_metadata()  # pairs, blocking or asyncio
    error = ExpbufError(exc.code(), details, reason_of(trailing))
    error.busy = busy(exc)
    return error


def past_the_servers_limit(details: str, server: str) -> str:
    """`details`, where they are gRPC's refusal of a message past the server's max_message_bytes,
    with what to do: the client's own limit, larger, sent the push whole (or in larger chunks)."""
    larger = TOO_LARGE_FOR_SERVER.search(details)
    if larger is None:
        return details
    return (
        f"{details} ({server} takes messages of at most {larger[2]} bytes, its max_message_bytes, and this client"
        f" sent one of {larger[1]}: nothing of it was stored; make the client with max_message_bytes = {larger[2]},"
        " and it sends larger pushes in chunks that fit)"
    )


def busy(exc: grpc.RpcError) -> bool:
    """Whether the server refused the call as having done nothing (wire.BUSY): the same call later may get in."""
    metadata = cast(Iterable[tuple[str, Any]], exc.trailing_metadata() or ())  # pairs, blocking or asyncio
    return any(key == BUSY for key, _ in metadata)


class ClientBase:
    """ClientSettings and channels shared by the blocking and the asyncio client."""

    _insecure_channel: Callable[..., Any]
    _secure_channel: Callable[..., Any]
    closed = False  # its close() began: a call cancelled since is its own, not a server's

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        token: str | None = None,
        tls: Tls | bool | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        wait_for_ready: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        push_chunk_bytes: int | None = None,
    ) -> None:
        """Connect to `target` (HOST:PORT: without a port, or as a URL, a ValueError says what to
        write). `token` is sent as a bearer token; `tls` is a Tls (a CA, and a client pair for
        mutual TLS) or True for the system's CAs. Every call has a
        deadline of `timeout` seconds, for all its attempts; pushes and reads are retried up to
        `retries` times (at most 4, gRPC's limit) while the server is UNAVAILABLE (safe: a push
        is idempotent). With `wait_for_ready`, they wait for a server that cannot be reached (a
        restart) until their deadline instead of failing UNAVAILABLE once their retries are
        spent. `max_message_bytes` is the largest message either way: a batch larger than it
        (or than the server's) comes in parts, which the client puts back together. A push
        larger than `push_chunk_bytes` is sent in chunks of that size, so that neither side
        holds gRPC's copies of one large message (None: 4 MiB, or max_message_bytes where that is
        less; 0: every push in one message, as a server of 0.2.0 or older needs). The connection opens lazily:

        ```python
        with BufferClient("127.0.0.1:50051", token=os.environ["EXPBUF_TOKEN"]) as client:
            client.push(experiences, table="grpo8")
        ```
        """
        checked_target(target)
        token = checked_token(token)
        if push_chunk_bytes is None:  # a smaller max_message_bytes alone is not refused for a chunk it did not name
            fits = min(DEFAULT_PUSH_CHUNK_BYTES, max_message_bytes)
            push_chunk_bytes = fits if fits >= LEAST_CHUNK_BYTES else 0  # under the least chunk: pushes go whole
        if push_chunk_bytes != 0 and not LEAST_CHUNK_BYTES <= push_chunk_bytes <= max_message_bytes:
            raise ValueError(
                f"push_chunk_bytes must be 0 (no chunks) or from {LEAST_CHUNK_BYTES} to max_message_bytes ="
                f" {max_message_bytes}, got {push_chunk_bytes}"
            )
        if retries > MAX_RETRIES:
            warnings.warn(
                f"retries={retries}: gRPC's retry policy makes at most {MAX_RETRIES} retries of a call, so the "
                f"client makes {MAX_RETRIES}; to wait for a server that restarts, pass wait_for_ready=True",
                UserWarning,
                stacklevel=2,
            )
        self._settings: dict[str, Any] = {
            "target": target, "token": token, "tls": tls, "timeout": timeout, "retries": retries,
            "wait_for_ready": wait_for_ready, "max_message_bytes": max_message_bytes,
            "push_chunk_bytes": push_chunk_bytes,
        }  # fmt: skip
        self.target = target
        self.timeout = timeout
        self.retries = max(0, min(retries, MAX_RETRIES))
        self.wait_for_ready = wait_for_ready
        # a chunk's message holds its table's name and its numbers beside its bytes: within max_message_bytes
        self.push_chunk_bytes = min(push_chunk_bytes, max_message_bytes - CHUNK_ENVELOPE) if push_chunk_bytes else 0
        self.max_message_bytes = max_message_bytes
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls if isinstance(tls, Tls) else Tls() if tls else None
        credentials = self._tls.credentials() if self._tls else None
        self._channel = self._open(target, credentials, service_config(self.retries))
        # The same options but the service config: without TLS, gRPC gives both channels one
        # connection; with TLS, each its own (it tells credentials apart by identity, and grpcio
        # makes them anew for each channel), opened on the first call that needs it.
        self._unretried_channel = self._open(target, credentials, service_config(0))
        # A push in chunks, made again by the client itself (RETRIED_METHODS says why): gRPC's
        # retries off, whose replay of a stream can leave a chunk unsent, and which would hold a
        # copy of every chunk sent until the push is answered. Its options differ, so it has a
        # connection of its own, opened on the first push in chunks.
        self._chunks_channel = self._open(target, credentials, service_config(0), retries=False)
        self._push_chunks = framed_method(self._chunks_channel, "PushStream")
        self._stub = pb_grpc.ExperienceBufferStub(self._channel)
        self._unretried = pb_grpc.ExperienceBufferStub(self._unretried_channel)
        self._sample_stream = sample_method(self._channel)  # replies read with one copy of their payload
        self._parts_methods = {
            (name, retried): parts_method(channel, name)
            for name in PARTS_METHODS
            for retried, channel in ((True, self._channel), (False, self._unretried_channel))
        }
        self._framed = {
            (name, retried): framed_method(channel, name)
            for name in FRAMED_METHODS
            for retried, channel in ((True, self._channel), (False, self._unretried_channel))
        }

    def clone(self, **changes: Any) -> Self:
        """A new client of the same server with this one's settings (token, TLS, ...) and its own
        channels, `changes` applied: a background thread's, with a deadline of its own."""
        return type(self)(**{**self._settings, **changes})

    def _open(self, target: str, credentials: grpc.ChannelCredentials | None, config: str, retries: bool = True) -> Any:
        """A channel to `target` with `config` for its service config; without `retries`, one
        without gRPC's retries, transparent ones included (its calls are made again by the client)."""
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            *RECONNECT,
            *KEEPALIVE,
            *RETRY_BUFFER,
            ("grpc.enable_retries", int(retries)),
            ("grpc.service_config_disable_resolution", 1),  # the policy is this one, never a DNS record's
            ("grpc.service_config", config),
        ]
        if credentials is None:
            return type(self)._insecure_channel(target, options=options)
        return type(self)._secure_channel(target, credentials, options=options)

    def push_stream(
        self, seconds: float, requests: Iterator[Any] | None = None, message_bytes: int | None = None
    ) -> Any:
        """A PushStream of this client's for its pushers (`pusher()`), over the channel without
        the retry policy: a pusher sends again what a broken stream left (pushers/pipeline.py).
        The blocking client's takes the iterator of its `requests`; the asyncio client's call is
        written to. It declares `message_bytes`, the most one of its messages takes (`_declaring`)."""
        method = self._framed["PushStream", False]
        keywords = {
            "timeout": seconds,
            "metadata": self._declaring(message_bytes),
            "wait_for_ready": self.wait_for_ready,
        }
        return method(**keywords) if requests is None else method(requests, **keywords)

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        """A Sample stream of this client's (both clients' call: the blocking one's takes its requests)."""
        self._still_open("Sample")
        return self._sample_stream(*args, **kwargs)

    def _still_open(self, method: str) -> None:
        """A call on a closed client refused before it is sent, CANCELLED as a sharded client's and a
        pusher's are, the same way by both clients (gRPC raises its own error of a closed channel, a
        ValueError blocking and a UsageError asyncio, neither an ExpbufError)."""
        if self.closed:
            left = " (a leased batch not acked comes back when its lease expires)" if method in LEASE_ENDS else ""
            raise ExpbufError(
                grpc.StatusCode.CANCELLED,
                f"{CLOSED_BEFORE % method}, nothing was sent{left}",
            )

    def _declaring(self, message_bytes: int | None) -> tuple[tuple[str, str], ...]:
        """A call's metadata: the token's, and where the call knows it, the most a message of it
        takes (wire.MESSAGE_BYTES), which the server reserves of max_inflight_bytes before each read."""
        return self._metadata if message_bytes is None else (*self._metadata, (MESSAGE_BYTES, str(message_bytes)))

    def _error(self, exc: grpc.RpcError, waited: bool = False) -> ExpbufError:
        """The ExpbufError of a failed call of this client's (call_error); `waited`: with wait_for_ready."""
        return call_error(exc, self._tls, self.target, waited)

    def _method(self, call: CallShape) -> tuple[Any, dict[str, Any]]:
        """The stub method that makes `call`, and its keywords. A call of a method under the retry
        policy that may not be retried (opening a writer, creating a dataset without exist_ok) goes
        over the channel without the policy: gRPC has no switch for one call. A push in chunks (the
        one PushStream made here: a pusher's streams are push_stream's) goes over the channel
        without gRPC's retries. Only a call that may be retried waits for the server with
        wait_for_ready."""
        self._still_open(call.method)
        retried = call.retry or call.method not in RETRIED_METHODS
        keywords = {
            "timeout": call.timeout or self.timeout,
            "metadata": self._declaring(call.message_bytes),
            "wait_for_ready": call.retry and self.wait_for_ready,
        }
        if call.method == "PushStream":
            return self._push_chunks, keywords
        if call.method in PARTS_METHODS:  # its replies read as Sample's are (sample_reply.py)
            return self._parts_methods[call.method, retried], keywords
        if call.method in FRAMED_METHODS:  # its requests written by hand (frames.py)
            return self._framed[call.method, retried], keywords
        return getattr(self._stub if retried else self._unretried, call.method), keywords


def framed_method(channel: Any, name: str) -> Any:
    """The call `name` of FRAMED_METHODS on `channel` (blocking or asyncio): its requests are the
    bytes frames.py writes, sent as they are."""
    kind, reply = FRAMED_METHODS[name]
    return getattr(channel, kind)(f"/{SERVICE}/{name}", request_serializer=None, response_deserializer=reply.FromString)
