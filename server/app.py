"""Assembles a running expbuf server: store, gRPC service, health, reflection, auth, TLS.

gRPC runs synchronously on a thread pool: the store serialises writes in its own
writer thread anyway, and a grpc.aio server over the same store measured the same on
sample and latency and 8-20 % more on push (bench/RESULTS.md). Each open Sample stream
holds one worker thread; server/rpc/interceptors/limits.py keeps waiting calls, and each scope's calls,
from taking them all.

The port is bound exclusively (no SO_REUSEPORT): a second server on a taken port would
otherwise start and split the connections between two stores. Start-up failures (a port
in use, a locked data directory, a missing TLS file) raise StartupError, one line that
names the cause.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path

import grpc
import lmdb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expbuf.proto.v1 import buffer_pb2, buffer_pb2_grpc

from .advantages.batch_stage import finish_batch
from .advantages.devices import check_device
from .advantages.start import FAILED, NOT_NEEDED, RUNNING, AdvantageStart
from .config import ServerConfig, TlsConfig
from .metrics_http import MetricsServer, start_metrics_server
from .rpc.draining import calls_left
from .rpc.interceptors.auth import TokenAuth
from .rpc.interceptors.base import Interceptors, ServiceInterceptor
from .rpc.interceptors.limits import RESERVED_THREADS, TableStreams, call_limits
from .rpc.interceptors.metrics import Metrics, RpcMetrics
from .rpc.interceptors.reflection import ReflectionLimits
from .rpc.interceptors.reply_memory import ReplyMemory
from .rpc.interceptors.unreadable import UnreadableRequests
from .rpc.push.inflight import InFlight, few_arenas, receive_window
from .rpc.push.ingest import Ingest, Stager
from .rpc.push.push_memory import PushMemory
from .rpc.sample.client_side import Confirmations
from .rpc.sample.replies import PassBytes, keep_reply_memory
from .rpc.sample.stalled_sends import StalledSends
from .rpc.service import ExperienceBufferService
from .store import ComputeJob, Store, TableExtension
from .store.schema.errors import ConfigError, Conflict, StoreError

log = logging.getLogger("expbuf")
SERVICE_NAME = buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"].full_name
MAINTENANCE_SECONDS = 0.5
STOP_POLL_SECONDS = 0.05  # how often a stop looks whether calls are left (rpc/draining.calls_left)


class StartupError(Exception):
    """The server cannot start; the message names the cause in one line."""


# The least time between a client's pings that the server takes while it sends nothing: expbuf's
# clients ping a connection every 20 s while a call is open (rpc/connection.KEEPALIVE), a stream
# that waits for data included. gRPC's default (5 min) would end such a stream after three pings.
PINGS_APART_MS = 10_000


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", PINGS_APART_MS),
    ]


def host_port(host: str, port: int) -> str:
    """host:port as gRPC and a log line take it: an IPv6 literal in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _check_port_free(host: str, port: int, kind: str) -> None:
    """Fail with the port's name before gRPC or the HTTP server tries it (gRPC would log its own lines
    and a vague error), and before the data directory is opened."""
    if port == 0:
        return
    try:
        family, sock_type, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot bind the {kind} port {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, sock_type, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise StartupError(f"cannot bind the {kind} port {host}:{port}: {exc.strerror}") from None


def _read(kind: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"TLS {kind} {path!r}: {exc.strerror or exc}") from None


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls is None:
        return None
    tls = config.tls
    key, cert = _read("key", tls.key), _read("certificate", tls.cert)
    client_ca = _read("client CA", tls.client_ca) if tls.client_ca else None
    _check_loads(tls)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def _check_loads(tls: TlsConfig) -> None:
    """Refuse TLS files the TLS library does not load (not PEM, a key of another certificate, an
    encrypted key), naming the setting: gRPC took them, then failed to bind the port with them, and
    the start was refused as "cannot bind the gRPC port: in use"."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=tls.cert)
    except ssl.SSLError as exc:
        raise StartupError(f"TLS [tls] cert {tls.cert!r} does not load as PEM certificates: {exc}") from None
    try:
        context.load_cert_chain(tls.cert, tls.key, password=lambda: b"")  # an encrypted key: refused, not asked for
    except ssl.SSLError as exc:
        raise StartupError(
            f"TLS [tls] key {tls.key!r} does not load with the certificate {tls.cert!r} (not an unencrypted PEM"
            f" private key, or the key of another certificate): {exc}"
        ) from None
    if tls.client_ca:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except ssl.SSLError as exc:
            raise StartupError(
                f"TLS [tls] client_ca {tls.client_ca!r} does not load as PEM certificates: {exc}"
            ) from None


# The upkeep's log lines: the count each says, its line, and the count it says beside it.
_UPKEEP_LINES = (
    ("leases_expired", "leases expired: %d (%d experiences requeued); %s", "requeued"),
    ("rollouts_returned", "grants expired: %d rollouts may start again; %s", ""),
    ("groups_timed_out", "incomplete groups timed out: %d; %s", ""),
    ("groups_stale_evicted", "stale ready groups evicted: %d; %s", ""),
)


def _by_table(tables: dict[str, dict[str, int]], kind: str, also: str = "") -> str:
    """An upkeep count by table, for its log line: "table a 2, b 1" (with `also` in brackets)."""
    counts = [
        f"{name} {kinds[kind]}" + (f" ({kinds.get(also, 0)})" if also else "")
        for name, kinds in sorted(tables.items())
        if kinds.get(kind)
    ]
    return ("table " if len(counts) == 1 else "tables ") + ", ".join(counts) if counts else "of tables dropped since"


def _summary(names: list[str], shown: int = 5) -> str:
    """A table count and the first few names: one start-up line, however many tables there are."""
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} ({', '.join(names[:shown])}{more})"


class ExpbufServer:
    """The store behind a gRPC server, with a maintenance thread for leases and timeouts."""

    def __init__(self, config: ServerConfig, *, extensions: Mapping[str, type[TableExtension]] | None = None) -> None:
        """`extensions`: the table extension kinds tables may name, by name (Store(extensions=...))."""
        self.config = config
        credentials = server_credentials(config)
        # Ports and devices first: a start refused for either leaves no data directory behind.
        _check_port_free(config.host, config.port, "gRPC")
        if config.metrics_port > 0:
            _check_port_free(config.metrics_host or config.host, config.metrics_port, "metrics")
        for table in config.tables:  # a device it has not: refused before any data directory is made
            try:
                check_device(table)
            except ConfigError as exc:
                raise StartupError(str(exc)) from None
        try:
            self.store = Store(
                config.data,
                check_at_open=config.check_at_open,
                scrub_mb_per_second=config.scrub_mb_per_second,
                scrub_interval_seconds=config.scrub_interval_seconds,
                batch_stage=finish_batch,
                extensions=extensions,
                max_push_bytes=config.max_push_bytes,
            )
        except (StoreError, OSError, lmdb.Error) as exc:
            raise StartupError(f"data directory {config.data}: {exc}") from None
        try:
            self._assemble(credentials)
        except BaseException:
            if hasattr(self, "service"):
                self.service.ingest.close()  # its processes end with the server that did not start
            self.store.close()
            raise

    def _assemble(self, credentials: grpc.ServerCredentials | None) -> None:
        config = self.config
        returned = self.store.release_holds()
        if returned:
            log.info("batches of streams broken by the last stop returned to the buffer: %d experiences", returned)
        try:  # all of the blocks' tables are created, or none
            created = self.store.create_tables(config.tables, exist_ok=True)
        except ConfigError as exc:  # an extension not registered
            raise StartupError(str(exc)) from None
        except Conflict as exc:  # the block edited since the table was made: the stored table is kept
            raise StartupError(
                f"config [[tables]]: {exc} (the request: the block in the config; a table's settings are fixed"
                " when it is created, so give the block the table's, or leave the table out of the config)"
            ) from None
        for table, made in zip(config.tables, created, strict=True):
            if made:
                log.info("table created from config: %s", table.described())
        self.metrics = Metrics(self.store, shard=config.shard)
        interceptors: list[ServiceInterceptor] = [RpcMetrics(self.metrics)]
        if config.tokens:
            interceptors.append(TokenAuth(config.tokens))
        interceptors.append(UnreadableRequests())  # after the token's check, before any reads a request
        self.call_limits = call_limits(config)
        interceptors.append(self.call_limits)
        interceptors.append(PassBytes())
        interceptors.append(StalledSends(config.confirm_seconds, heard={"Sample": Confirmations}))
        self.reply_memory = ReplyMemory(config.max_inflight_bytes)
        interceptors.append(self.reply_memory)
        self.inflight = InFlight(config.max_inflight_bytes)
        interceptors.append(
            PushMemory(
                self.inflight,
                stream_wait=config.push_stream_idle_seconds / 2,
                min_mb_per_second=config.push_min_mb_per_second,
                grace=config.push_stream_idle_seconds,
                stager=Stager(self.store, config.max_metadata_bytes),
                max_push_bytes=config.max_push_bytes,
                max_message_bytes=config.max_message_bytes,
            )
        )
        keep_reply_memory()
        few_arenas()
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers + RESERVED_THREADS, thread_name_prefix="expbuf-rpc"),
            interceptors=[Interceptors(interceptors, others=ReflectionLimits())],
            options=channel_options(config.max_message_bytes)
            + receive_window(config.max_inflight_bytes, config.workers),
        )
        self.service = ExperienceBufferService(
            self.store,
            metrics=self.metrics,
            max_message_bytes=config.max_message_bytes,
            advantage_device="",  # known once the advantage worker runs (advantages/start.py)
            bind_leases=bool(config.tokens),
            ingest=Ingest(config.ingest_workers, config.max_metadata_bytes),
            table_streams=TableStreams(config.table_stream_limit),
            push_stream_idle_seconds=config.push_stream_idle_seconds,
            push_stream_window=config.push_stream_window,
            max_wait_seconds=config.max_wait_seconds,
            max_confirm_seconds=config.confirm_seconds,
        )
        # one-value estimators: computed by the push (advantages/worker.py), once torch has loaded
        self.advantages = AdvantageStart(
            self.store,
            torch_threads=config.torch_threads,
            at_start=config.advantage_worker == "at_start",
            on_computed=self._advantages_computed,
            on_failed=self._advantages_failed,
            on_state=self._advantage_state,
        )
        self.metrics.advantage_worker_up.set_function(
            lambda: float(self.service.advantage_worker_state in (RUNNING, NOT_NEEDED))
        )
        buffer_pb2_grpc.add_ExperienceBufferServicer_to_server(self.service, self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        address = host_port(config.host, config.port)
        try:
            if credentials is None:
                self.port = self.grpc.add_insecure_port(address)
            else:
                self.port = self.grpc.add_secure_port(address, credentials)
        except RuntimeError:
            raise StartupError(f"cannot bind the gRPC port {address}: in use, or not an address of this host") from None
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="expbuf-maintenance", daemon=True)
        self.metrics_port = 0
        self._metrics_http: MetricsServer | None = None

    def _advantages_computed(self, job: ComputeJob, seconds: float) -> None:
        estimator = job.config.advantages.estimator
        timed = self.metrics.of_table(self.metrics.advantage_seconds, job.table, estimator, table_id=job.table_id)
        if timed is not None:  # else dropped while it computed
            timed.observe(seconds)

    def _advantages_failed(self, job: ComputeJob, outcome: str, groups: int) -> None:
        estimator = job.config.advantages.estimator
        failures = self.metrics.of_table(
            self.metrics.advantage_failures, job.table, estimator, outcome, table_id=job.table_id
        )
        if failures is not None:  # else dropped while it computed
            failures.inc(groups)

    def _advantage_state(self, state: str, detail: str) -> None:
        """What ServerInfo says of the advantage worker: its state, with the device it computes
        on once running, or why advantages cannot be computed once failed."""
        self.service.advantage_worker_state = state
        if state == RUNNING:
            self.service.advantage_device = detail
        elif state == FAILED:
            self.service.advantage_worker_failure = detail

    def start(self) -> ExpbufServer:
        """Serve; on a StartupError nothing is left running and the store is closed."""
        if self.config.metrics_port >= 0:
            host = self.config.metrics_host or self.config.host
            try:
                metrics_http = start_metrics_server(self.config.metrics_port, host.strip("[]"), self.metrics.exported)
            except OSError as exc:
                self.service.ingest.close()
                self.store.close()
                raise StartupError(
                    f"cannot bind the metrics port {host}:{self.config.metrics_port}: {exc.strerror or exc}"
                ) from None
            self._metrics_http, self.metrics_port = metrics_http, metrics_http.server_port
        self.grpc.start()
        self.advantages.start()  # torch loads, where a table needs it, while the server already serves
        self._maintenance.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "expbuf listening on %s (metrics %s, tls %s, tokens %s, data %s, tables %s)",
            host_port(self.config.host, self.port),
            host_port(self.config.metrics_host or self.config.host, self.metrics_port)
            if self.config.metrics_port >= 0
            else "off",
            "on" if self.config.tls else "off",
            "on" if self.config.tokens else "off",
            self.config.data,
            _summary([t.name for t in self.store.list_tables()]),
        )
        return self

    @property
    def broken(self) -> str | None:
        """Why the server must stop, the store taking no more writes (Store.broken): its health says
        NOT_SERVING from then on, and `expbuf serve` stops it and exits 3 for its supervisor to start
        it again; None while it serves."""
        return self.store.broken

    def _maintain(self) -> None:
        while not self._stop.wait(MAINTENANCE_SECONDS):
            if self.store.broken is not None:
                self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
                return
            try:
                done = self.store.tick()
            except Exception:
                log.exception("maintenance failed; retrying")
                continue
            tables = self.store.upkeep_by_table()
            for kind, line, also in _UPKEEP_LINES:
                if done[kind]:
                    counts = (done[kind], done[also]) if also else (done[kind],)
                    log.info(line, *counts, _by_table(tables, kind, also))

    def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, end the open streams at their next safe point (rpc/draining.py), let the
        other running RPCs finish within grace, commit, close."""
        self.health.enter_graceful_shutdown()
        stopped = self.grpc.stop(grace)  # no new RPCs from now on
        self.service.draining.begin(grace)
        self.store.wake()  # Sample streams waiting for data see the stop at once
        while not stopped.wait(STOP_POLL_SECONDS):
            if not calls_left(self.grpc):  # only connections without calls hold gRPC's stop
                self.grpc.stop(None)
                break
        ended = self.service.draining.ended
        log.info(
            "streams ended by the stop: %d (%d PushStream, %d Sample), with UNAVAILABLE: their clients send again",
            ended.total(),
            ended["PushStream"],
            ended["Sample"],
        )
        self._stop.set()
        if self._maintenance.is_alive():
            self._maintenance.join()
        self.advantages.stop()
        if self._metrics_http is not None:
            # Its serve loop looks for the stop only between polls of half a second; a listening
            # socket shut down wakes the poll at once (later accepts fail, and the loop ends).
            self._metrics_http.socket.shutdown(socket.SHUT_RDWR)
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None  # a second stop finds nothing more to stop
        self.service.ingest.close()
        self.store.close()
        log.info("expbuf stopped; every acknowledged write is committed")
