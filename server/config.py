"""Server settings from defaults, a TOML file, EXPBUF_* environment variables and flags.

Later sources win: defaults < TOML file < environment < command line. The TOML file
may also declare tables (created at start, or checked against the stored ones):

    data = "/srv/expbuf"
    host = "0.0.0.0"
    port = 50051
    metrics_port = 9400
    metrics_host = "127.0.0.1"    # default: the same address as host
    workers = 64                  # concurrent calls
    max_sample_streams = 48       # open Sample streams (default: three quarters of workers)
    max_push_streams = 32         # open PushStreams (default: half the workers)
    max_waiting_admits = 16       # Admit calls waiting for room (default: a quarter of the workers)
    max_waiting_claims = 16       # Claim calls waiting for prompts (default: a quarter of the workers)
    reserved_workers = 8          # workers calls that wait idle may not take (default: an eighth)
    push_scope_workers = 16       # workers kept for push-scope calls (default: a quarter)
    sample_scope_workers = 16     # workers kept for sample-scope calls (default: a quarter)
    push_stream_idle_seconds = 120  # a PushStream that sends nothing this long is ended
    push_stream_window = 8        # pushes a PushStream reads and stores ahead of its replies
    push_min_mb_per_second = 0.1  # a push in chunks slower than this over an idle time is ended
    max_wait_seconds = 600        # the longest a Sample batch, an Admit, a Claim or a push waits
    max_confirm_seconds = 600     # the longest a sent batch waits for its confirmation (default: max_wait_seconds)
    max_inflight_bytes = 1073741824  # payload bytes pushes and PutValues in progress may hold; more wait or are refused
    max_push_bytes = 17179869184  # the largest push in chunks (a push of large experiences is stored as it comes)
    max_metadata_bytes = 8388608  # an experience's metadata written out; a push with more is refused
    check_at_open = "quick"       # "quick": the directory's structure; "full": every record and digest before serving
    scrub_mb_per_second = 32      # the background check of every payload after the start (0: off)
    scrub_interval_seconds = 86400  # and again this long after each pass began
    ingest_processes = 1          # processes that validate and pack pushes (default: cores - 1, at most 4)
    torch_threads = 1             # torch's threads for the server's advantages (0: torch's own default)
    advantage_worker = "when_needed"  # torch loaded when a table needs advantages computed; "at_start": at once
    max_message_bytes = 268435456  # the largest gRPC message either way, at least 65536

    [tls]
    cert = "server.pem"
    key = "server.key"
    client_ca = "ca.pem"          # mutual TLS: every client must present a certificate this CA signed;
                                  # leave it out for TLS alone (clients need only the CA of cert)

    [[tokens]]
    token = "..."                 # or token_env = "NAME" to read it from the environment
    scopes = ["push"]             # push | sample | admin

    [[tables]]
    name = "grpo"
    group_size = 8
    estimator = "grpo"
"""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from expbuf.client.rpc.wire import LEAST_CHUNK_BYTES
from expbuf.client.schema.tokens import bearer_token

from .store.schema.errors import ConfigError, clip
from .store.schema.table_config import TableConfig

log = logging.getLogger("expbuf.config")
# The server's TLS variables, and the names they had before (read for one more release, with a
# warning): EXPBUF_TLS_CERT and EXPBUF_TLS_KEY meant the server's pair here and the client's
# pair in the Trinity-RFT plug-in, so a host running both presented the server's key as a client.
SERVER_TLS_ENV = {
    "cert": ("EXPBUF_SERVER_TLS_CERT", "EXPBUF_TLS_CERT"),
    "key": ("EXPBUF_SERVER_TLS_KEY", "EXPBUF_TLS_KEY"),
    "client_ca": ("EXPBUF_SERVER_TLS_CLIENT_CA", "EXPBUF_TLS_CLIENT_CA"),
}


def _server_tls_env() -> dict[str, str]:
    """The server's TLS files from the environment, under their names or (warned) their old ones."""
    found = {}
    for name, (var, old) in SERVER_TLS_ENV.items():
        if var in os.environ:
            found[name] = os.environ[var]
        elif old in os.environ:
            log.warning("%s is renamed %s (the old name is read until the next release)", old, var)
            found[name] = os.environ[old]
    return found


SCOPES = ("push", "sample", "admin")
# The plain kinds of settings, by their annotation: what a value must be, and how a refusal says it.
_KINDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "int": (int, "an integer"),
    "float": ((int, float), "a number"),
    "str": (str, "a string"),
}
_MOST_MESSAGE_BYTES = 2**31 - 1  # gRPC's message lengths are int32


@dataclass(frozen=True)
class TlsConfig:
    cert: str  # the server's certificate chain (PEM file)
    key: str  # the server's private key (PEM file)
    client_ca: str | None = None  # CA that clients' certificates must chain to: mutual TLS; None: any client


@dataclass(frozen=True)
class ServerConfig:
    data: str = "./expbuf-data"  # the data directory: the LMDB environment and its lock
    host: str = "127.0.0.1"  # the address gRPC listens on (0.0.0.0: every interface)
    port: int = 50051  # gRPC's port (0: a free one, logged and read back)
    metrics_port: int = 9400  # the Prometheus /metrics port (0: a free one; -1: none)
    # /metrics needs no token and names the tables: bind it where only the scraper reaches it.
    metrics_host: str | None = None  # None: the same address as host
    max_message_bytes: int = 256 << 20  # the largest gRPC message either way: a push's chunk, a reply's part
    workers: int = 64  # the threads that serve calls; every limit below is a share of them
    max_sample_streams: int | None = None  # None: three quarters of workers
    # Open Sample streams on one table, so the trainers of one table cannot take every stream.
    max_table_streams: int | None = None  # None: max_sample_streams
    max_push_streams: int | None = None  # None: half the workers
    max_waiting_admits: int | None = None  # None: a quarter of the workers
    # Claims waiting for prompts at once; more wait in their clients, which ask again (rpc/interceptors/limits.py).
    max_waiting_claims: int | None = None  # None: a quarter of the workers
    # Workers kept for the calls that do not wait idle: no class of call can take every one
    # (rpc/interceptors/limits.py).
    reserved_workers: int | None = None  # None: an eighth of the workers, at least 1
    # Workers kept for each scope's calls, which the other scope's calls cannot take (rpc/interceptors/limits.py).
    push_scope_workers: int | None = None  # None: a quarter of the workers (see scope_shares)
    sample_scope_workers: int | None = None  # None: a quarter of the workers (see scope_shares)
    push_stream_idle_seconds: float = 120.0  # a PushStream that sends nothing for this long is ended
    # Pushes a PushStream has read and not yet answered: while the writer stores some, the stream
    # reads and parses the next, and the next step stores all it parsed in one commit (rpc/push/push_stream.py).
    push_stream_window: int = 8
    # A push in chunks must bring this many MB (10^6 bytes) a second over every push_stream_idle_seconds
    # after its first, or it is ended: it holds a worker, the room it announced and what it staged
    # (rpc/push/push_chunks.py).
    push_min_mb_per_second: float = 0.1
    # The longest a Sample batch, a waiting Admit or Claim, or a push waiting for room waits.
    max_wait_seconds: float = 600.0
    # The longest a Sample batch sent waits for its client's confirmation, counted from the later of
    # its send and the client's confirmation of the batch before: a trainer's step. Past it the
    # stream's unconfirmed batches return to the buffer and it ends DEADLINE_EXCEEDED (rpc/sample/sample_stream.py).
    # Also the longest a streamed reply's message waits for its client to take it (rpc/sample/stalled_sends.py).
    max_confirm_seconds: float | None = None  # None: max_wait_seconds
    # Payload bytes held by pushes in progress; new pushes wait for their deadline past it (rpc/push/inflight.py).
    max_inflight_bytes: int = 1 << 30
    # The largest push in chunks: one whose large experiences are stored as they arrive holds little
    # of max_inflight_bytes but writes all of itself to disk before its commit (rpc/push/inflight.py).
    max_push_bytes: int = 16 << 30
    # An experience's metadata written out (its pickle, shared references expanded): a push with a
    # larger one is refused. The server holds an experience's metadata twice while it repacks it.
    max_metadata_bytes: int = 8 << 20
    # What a start checks before serving: "quick" only the format, catalogue, counters, leases and
    # grants (every read checks the payloads it serves, and the scrub checks the rest); "full"
    # reads the whole file first (every record, digest, index and counter, about 3 GB/s).
    check_at_open: str = "quick"
    # The background scrub (store/services/scrub.py): the payload and record bytes it reads per second at
    # most (0: no scrub), and how long after a pass began the next begins.
    scrub_mb_per_second: float = 32.0
    scrub_interval_seconds: float = 86400.0  # from the start of one scrub pass to the next
    # Processes that validate and pack pushed payloads (0: the server process alone does it).
    ingest_processes: int | None = None  # None: ingest_workers() picks by the cores
    # torch's intra-op threads in the server process, where advantages are computed (0: torch's own
    # default, one per core). One by default: the server's computations are small (a push's groups, a
    # worker's batch), and a second thread on a few cores costs every table CPU (bench/RESULTS.md).
    torch_threads: int = 1
    # When torch loads and the advantage worker starts (server/advantages/start.py), after the
    # server listens either way: "when_needed", once a table needs advantages computed (a push to a
    # table with an estimator, or groups left to compute at the start), so a server that never
    # computes any never loads torch; "at_start", at once, so the first pushes compute their
    # groups' advantages themselves and a torch that cannot load shows at the start.
    advantage_worker: str = "when_needed"
    log_format: str = "text"  # "text" lines, or "json": one JSON object per line
    # This server's name among the shards of a sharded buffer; labels its metrics.
    shard: str = ""
    tls: TlsConfig | None = None  # TLS for gRPC (the `[tls]` block); None: plaintext
    # token -> scopes; empty means no authentication.
    tokens: dict[str, frozenset[str]] = field(default_factory=dict)
    # The tables made at start (`[[tables]]` blocks) where not there yet; one there with other
    # settings stops the start.
    tables: tuple[TableConfig, ...] = ()

    def _check_kinds(self) -> None:
        """Each setting of a plain kind (an integer, a number, a string; or None where it may be)
        of that kind, named where not: a TOML value of another kind (host = 5, port = true) would
        fail later in a traceback, or a bool pass for an integer."""
        for each in fields(self):
            kind = str(each.type)
            optional = kind.endswith(" | None")
            want = _KINDS.get(kind.removesuffix(" | None"))
            value = getattr(self, each.name)
            if want is None or (value is None and optional):
                continue
            if isinstance(value, bool) or not isinstance(value, want[0]):
                maybe = " (or unset)" if optional else ""
                raise ConfigError(f"{each.name} must be {want[1]}{maybe}, got {clip(repr(value), 60)}")

    @property
    def ingest_workers(self) -> int:
        """ingest_processes, or by default one process per core this server may run on but
        one, at most 4: the server's own process decodes a push too when no other is being
        decoded, and on 2 cores one worker pushes faster than two (bench/RESULTS.md)."""
        if self.ingest_processes is not None:
            return self.ingest_processes
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(4, cores - 1))

    @property
    def confirm_seconds(self) -> float:
        """How long a sent batch waits for its confirmation: max_confirm_seconds, by default
        max_wait_seconds, the server's other bound on a Sample stream's idle worker (a
        trainer's step may be long; a lease, which a trainer may renew, would bound it wrongly)."""
        return self.max_wait_seconds if self.max_confirm_seconds is None else self.max_confirm_seconds

    @property
    def sample_stream_limit(self) -> int:
        """Open Sample streams allowed; the rest of the workers stay free for other calls."""
        return self.max_sample_streams if self.max_sample_streams is not None else max(1, self.workers * 3 // 4)

    @property
    def table_stream_limit(self) -> int:
        """Open Sample streams allowed on one table."""
        return self.max_table_streams if self.max_table_streams is not None else self.sample_stream_limit

    @property
    def push_stream_limit(self) -> int:
        return self.max_push_streams if self.max_push_streams is not None else max(1, self.workers // 2)

    @property
    def waiting_admit_limit(self) -> int:
        return self.max_waiting_admits if self.max_waiting_admits is not None else max(1, self.workers // 4)

    @property
    def waiting_claim_limit(self) -> int:
        return self.max_waiting_claims if self.max_waiting_claims is not None else max(1, self.workers // 4)

    @property
    def reserved_worker_count(self) -> int:
        return self.reserved_workers if self.reserved_workers is not None else max(1, self.workers // 8)

    @property
    def scope_shares(self) -> dict[str, int]:
        """Workers kept for each scope's calls: by default a quarter of the workers each, or half of
        those outside reserved_workers if that is fewer (so both shares fit beside the reserve)."""
        default = min(self.workers // 4, (self.workers - self.reserved_worker_count) // 2)
        push, sample = self.push_scope_workers, self.sample_scope_workers
        return {"push": default if push is None else push, "sample": default if sample is None else sample}

    def __post_init__(self) -> None:
        self._check_kinds()  # each setting's kind, here alone: the checks below are of its range
        if not self.data:
            raise ConfigError("data must name a directory (an empty one would be the working directory)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be a port number (0-65535; 0 picks a free one), got {self.port!r}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"metrics_port must be -1 (off) or a port number (0 picks a free one), got {self.metrics_port!r}"
            )
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format is {self.log_format!r}; expected text or json")
        if not LEAST_CHUNK_BYTES <= self.max_message_bytes <= _MOST_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be an integer from {LEAST_CHUNK_BYTES} (a client's least chunk of a push) to"
                f" {_MOST_MESSAGE_BYTES} (gRPC's bound), got {self.max_message_bytes!r}"
            )
        processes = self.ingest_processes
        if processes is not None and (not 0 <= processes <= 64):
            raise ConfigError(f"ingest_processes must be an integer from 0 to 64, got {self.ingest_processes!r}")
        threads = self.torch_threads
        if not 0 <= threads <= 1024:
            raise ConfigError(f"torch_threads must be an integer from 0 (torch's default) to 1024, got {threads!r}")
        if self.advantage_worker not in ("when_needed", "at_start"):
            raise ConfigError(f"advantage_worker must be 'when_needed' or 'at_start', got {self.advantage_worker!r}")
        if self.workers < 2:
            raise ConfigError(f"workers must be an integer >= 2, got {self.workers!r}")
        streams = self.max_sample_streams
        if streams is not None and (not 1 <= streams < self.workers):
            raise ConfigError(
                f"max_sample_streams must be an integer from 1 to workers - 1 = {self.workers - 1}, got {streams!r}"
            )
        per_table = self.max_table_streams
        if per_table is not None and (not 1 <= per_table <= self.sample_stream_limit):
            raise ConfigError(
                f"max_table_streams must be an integer from 1 to max_sample_streams = {self.sample_stream_limit}, "
                f"got {per_table!r}"
            )
        for name in ("max_push_streams", "max_waiting_admits", "max_waiting_claims", "reserved_workers"):
            value = getattr(self, name)
            if value is not None and (not 1 <= value < self.workers):
                raise ConfigError(
                    f"{name} must be an integer from 1 to workers - 1 = {self.workers - 1}, got {value!r}"
                )
        for name in ("push_scope_workers", "sample_scope_workers"):
            value = getattr(self, name)
            if value is not None and (not 0 <= value < self.workers):
                raise ConfigError(
                    f"{name} must be an integer from 0 to workers - 1 = {self.workers - 1}, got {value!r}"
                )
        kept = sum(self.scope_shares.values())
        if kept > self.workers - self.reserved_worker_count:
            raise ConfigError(
                f"push_scope_workers + sample_scope_workers = {kept} must be at most workers - reserved_workers = "
                f"{self.workers - self.reserved_worker_count}"
            )
        for name in ("push_stream_idle_seconds", "max_wait_seconds", "max_confirm_seconds"):
            value = getattr(self, name)
            if name == "max_confirm_seconds" and value is None:
                continue
            if not 0 < value <= 86400:
                raise ConfigError(f"{name} must be a number of seconds above 0 and at most 86400, got {value!r}")
        rate = self.push_min_mb_per_second
        if not 0 < rate <= 100_000:
            raise ConfigError(f"push_min_mb_per_second must be a number above 0 and at most 100000, got {rate!r}")
        window = self.push_stream_window
        if not 1 <= window <= 1024:
            raise ConfigError(f"push_stream_window must be an integer from 1 to 1024, got {window!r}")
        if self.max_inflight_bytes < 1 << 20:
            raise ConfigError(f"max_inflight_bytes must be an integer >= 1048576, got {self.max_inflight_bytes!r}")
        if self.max_push_bytes < 1 << 20:
            raise ConfigError(f"max_push_bytes must be an integer >= 1048576, got {self.max_push_bytes!r}")
        if self.max_metadata_bytes < 1 << 16:
            raise ConfigError(f"max_metadata_bytes must be an integer >= 65536, got {self.max_metadata_bytes!r}")
        if self.check_at_open not in ("full", "quick"):
            raise ConfigError(f"check_at_open must be 'full' or 'quick', got {self.check_at_open!r}")
        rate = self.scrub_mb_per_second
        if not 0 <= rate <= 100_000:
            raise ConfigError(f"scrub_mb_per_second must be a number from 0 (no scrub) to 100000, got {rate!r}")
        interval = self.scrub_interval_seconds
        if not 60 <= interval <= 31_536_000:
            raise ConfigError(
                f"scrub_interval_seconds must be a number of seconds from 60 to 31536000 (a year), got {interval!r}"
            )
        for token, scopes in self.tokens.items():
            if not token:
                raise ConfigError("a token is empty")
            unknown = set(scopes) - set(SCOPES)
            if unknown:
                raise ConfigError(f"unknown token scope(s) {sorted(unknown)}; expected {', '.join(SCOPES)}")


_ENV = {
    "EXPBUF_DATA": ("data", str),
    "EXPBUF_HOST": ("host", str),
    "EXPBUF_PORT": ("port", int),
    "EXPBUF_METRICS_PORT": ("metrics_port", int),
    "EXPBUF_METRICS_HOST": ("metrics_host", str),
    "EXPBUF_MAX_MESSAGE_BYTES": ("max_message_bytes", int),
    "EXPBUF_WORKERS": ("workers", int),
    "EXPBUF_MAX_SAMPLE_STREAMS": ("max_sample_streams", int),
    "EXPBUF_MAX_TABLE_STREAMS": ("max_table_streams", int),
    "EXPBUF_MAX_PUSH_STREAMS": ("max_push_streams", int),
    "EXPBUF_MAX_WAITING_ADMITS": ("max_waiting_admits", int),
    "EXPBUF_MAX_WAITING_CLAIMS": ("max_waiting_claims", int),
    "EXPBUF_RESERVED_WORKERS": ("reserved_workers", int),
    "EXPBUF_PUSH_SCOPE_WORKERS": ("push_scope_workers", int),
    "EXPBUF_SAMPLE_SCOPE_WORKERS": ("sample_scope_workers", int),
    "EXPBUF_PUSH_STREAM_IDLE_SECONDS": ("push_stream_idle_seconds", float),
    "EXPBUF_PUSH_STREAM_WINDOW": ("push_stream_window", int),
    "EXPBUF_PUSH_MIN_MB_PER_SECOND": ("push_min_mb_per_second", float),
    "EXPBUF_MAX_WAIT_SECONDS": ("max_wait_seconds", float),
    "EXPBUF_MAX_CONFIRM_SECONDS": ("max_confirm_seconds", float),
    "EXPBUF_MAX_INFLIGHT_BYTES": ("max_inflight_bytes", int),
    "EXPBUF_MAX_PUSH_BYTES": ("max_push_bytes", int),
    "EXPBUF_MAX_METADATA_BYTES": ("max_metadata_bytes", int),
    "EXPBUF_CHECK_AT_OPEN": ("check_at_open", str),
    "EXPBUF_SCRUB_MB_PER_SECOND": ("scrub_mb_per_second", float),
    "EXPBUF_SCRUB_INTERVAL_SECONDS": ("scrub_interval_seconds", float),
    "EXPBUF_INGEST_PROCESSES": ("ingest_processes", int),
    "EXPBUF_TORCH_THREADS": ("torch_threads", int),
    "EXPBUF_ADVANTAGE_WORKER": ("advantage_worker", str),
    "EXPBUF_LOG_FORMAT": ("log_format", str),
    "EXPBUF_SHARD": ("shard", str),
}


def _token(text: str, where: str, tokens: dict[str, frozenset[str]]) -> str:
    """A token as a client sends it (`Bearer TOKEN`): its surrounding whitespace left out (a value
    read from a file or a secret ends in a newline, and no client could send it); one that holds a
    character a gRPC header cannot carry, or that `tokens` holds already, is refused naming
    `where`, without the token (a secret)."""
    try:
        token = bearer_token(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: the {exc}") from None
    if token in tokens:
        raise ConfigError(f"{where}: the same token is given again; give each token once, with all its scopes")
    return token


def parse_tokens(spec: str) -> dict[str, frozenset[str]]:
    """ "TOKEN:push,sample;TOKEN2:admin" -> {token: scopes} (the EXPBUF_TOKENS form). One that names
    no token is refused, not taken for "no tokens": set, it replaces the config file's tokens, and an
    empty one would turn authentication off without a word."""
    tokens: dict[str, frozenset[str]] = {}
    for number, part in enumerate(filter(None, (p.strip() for p in spec.split(";"))), 1):
        token, sep, scopes = part.rpartition(":")
        if not sep or not token.strip():
            raise ConfigError("EXPBUF_TOKENS entries are TOKEN:scope[,scope...] separated by ';'")
        token = _token(token, f"EXPBUF_TOKENS: token {number}", tokens)
        tokens[token] = frozenset(s.strip() for s in scopes.split(",") if s.strip())
        if not tokens[token]:
            raise ConfigError(f"EXPBUF_TOKENS: token {number} has no scopes; give it some of {', '.join(SCOPES)}")
    if not tokens:
        raise ConfigError(
            "EXPBUF_TOKENS names no token: give TOKEN:scope[,scope...] entries separated by ';', or unset it "
            "(the config file's tokens, or none, then hold)"
        )
    return tokens


_TLS_KEYS = ("cert", "key", "client_ca")
_TOKEN_KEYS = ("token", "token_env", "scopes")


def _tls_of(path: Path, tls: object) -> TlsConfig:
    """The [tls] block: each setting a file's path (relative to the config file); another is refused
    by name, as a misspelt client_ca would otherwise leave TLS one-way without a word."""
    if not isinstance(tls, dict):
        raise ConfigError(f"config file {path}: [tls] must be a table of cert, key and client_ca")
    unknown = sorted(set(tls) - set(_TLS_KEYS))
    if unknown:
        raise ConfigError(
            f"config file {path}: [tls] has no setting {clip(unknown[0], 40)}; its settings are cert, key, client_ca"
        )
    if not {"cert", "key"} <= set(tls):
        raise ConfigError(f"config file {path}: [tls] needs cert and key")
    for name, value in tls.items():
        if not isinstance(value, str) or not value:
            raise ConfigError(f"config file {path}: [tls] {name} must be a file's path, got {clip(repr(value), 60)}")
    base = path.parent
    ca = tls.get("client_ca")
    return TlsConfig(cert=str(base / tls["cert"]), key=str(base / tls["key"]), client_ca=str(base / ca) if ca else None)


def _tokens_of(path: Path, entries: object) -> dict[str, frozenset[str]]:
    """The [[tokens]] blocks: each a token (or the variable holding it) and its scopes, at least one."""
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ConfigError(f"config file {path}: tokens must be [[tokens]] blocks, each a token and its scopes")
    tokens: dict[str, frozenset[str]] = {}
    for number, entry in enumerate(entries, 1):
        unknown = sorted(set(entry) - set(_TOKEN_KEYS))
        if unknown:
            raise ConfigError(
                f"config file {path}: [[tokens]] entry {number} has no setting {clip(unknown[0], 40)}; "
                "its settings are token (or token_env) and scopes"
            )
        variable = entry.get("token_env")
        if "token" in entry and not isinstance(entry["token"], str):
            raise ConfigError(f"config file {path}: [[tokens]] entry {number}'s token must be a string")
        token = entry.get("token") or (os.environ.get(variable, "") if isinstance(variable, str) else "")
        token = token.strip()
        if not token and variable is not None:
            raise ConfigError(
                f"config file {path}: [[tokens]] entry {number} reads its token from the variable"
                f" {clip(variable, 60)}, which is unset or empty in the server's environment"
            )
        if not token:
            raise ConfigError(f"config file {path}: [[tokens]] entry {number} has no token (token or token_env)")
        scopes = entry.get("scopes")
        if not isinstance(scopes, list) or not scopes or not all(isinstance(scope, str) for scope in scopes):
            raise ConfigError(
                f"config file {path}: [[tokens]] entry {number} has no scopes; give it scopes = [...] of "
                f"{', '.join(SCOPES)} (a token of none could make no call)"
            )
        tokens[_token(token, f"config file {path}: [[tokens]] entry {number}", tokens)] = frozenset(scopes)
    return tokens


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}), as TOML is") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    known = {f.name for f in fields(ServerConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {k: v for k, v in raw.items() if k not in ("tls", "tokens", "tables")}
    if "tls" in raw:
        values["tls"] = _tls_of(path, raw["tls"])
    tokens = _tokens_of(path, raw.get("tokens", []))
    if tokens:
        values["tokens"] = tokens
    tables = raw.get("tables", [])
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise ConfigError(f"config file {path}: tables must be [[tables]] blocks, each a table's settings")
    values["tables"] = tuple(TableConfig.from_settings(t) for t in tables)
    names = [table.name for table in values["tables"]]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        named = ", ".join(f"'{clip(name, 64)}'" for name in twice)
        raise ConfigError(f"config file {path}: [[tables]] names {named} twice; give each table one block")
    return values


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
    """Merge defaults, the TOML file, EXPBUF_* variables and explicit overrides."""
    config = ServerConfig()
    if path:
        config = _sourced(config, _from_toml(Path(path)), lambda name: f"set in the config file {path}")
    env: dict[str, Any] = {}
    set_by: dict[str, str] = {}
    for var, (name, kind) in _ENV.items():
        if var in os.environ:
            try:
                env[name] = kind(os.environ[var])
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]!r} is not a valid {kind.__name__}") from None
            set_by[name] = f"set by {var}={os.environ[var]!r}"
    if "EXPBUF_TOKENS" in os.environ:
        env["tokens"] = parse_tokens(os.environ["EXPBUF_TOKENS"])
    tls = _server_tls_env()
    if tls:  # each variable sets its own setting over the file's: a CA alone makes the file's TLS mutual
        was = config.tls or TlsConfig(cert="", key="")
        cert, key = tls.get("cert", was.cert), tls.get("key", was.key)
        if not cert or not key:
            given = " and ".join(SERVER_TLS_ENV[name][0] for name in tls)
            missing = " and ".join(what for what, have in (("a certificate", cert), ("a key", key)) if not have)
            raise ConfigError(
                f"{given} is set without {missing}: give EXPBUF_SERVER_TLS_CERT and EXPBUF_SERVER_TLS_KEY "
                "(or cert and key in the config file's [tls])"
            )
        env["tls"] = TlsConfig(cert=cert, key=key, client_ca=tls.get("client_ca", was.client_ca or "") or None)
    config = _sourced(config, env, lambda name: set_by.get(name, "set in the environment"))
    explicit = {k: v for k, v in (overrides or {}).items() if v is not None}
    return _sourced(config, explicit, lambda name: "set on the command line")


def _sourced(config: ServerConfig, values: dict[str, Any], source: Callable[[str], str]) -> ServerConfig:
    """`config` with `values`; a refusal of one of them says where it was set (`source` of its
    name): an operator looks there, not in the other places a setting comes from."""
    try:
        return replace(config, **values)
    except ConfigError as exc:
        named = sorted((name for name in values if str(exc).startswith(name)), key=len)
        if not named:
            raise
        raise ConfigError(f"{exc} ({source(named[-1])})") from None
