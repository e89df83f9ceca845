"""The `expbuf` command line: serve a data directory, query a running server, and check, repair
and back up a data directory (commands/datadir.py).

The server's modules (and torch, which they import) load only for `serve` and the data directory's
commands, so that `expbuf health`, which the container runs every few seconds, answers quickly.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from expbuf.client import Tls
from expbuf.client.rpc.connection import call_error, checked_target, checked_token

from . import __version__, logs
from .commands import CommandError
from .commands.datadir import add_datadir_commands
from .commands.datasets import add_dataset_commands
from .commands.export import add_export_command, run_export
from .commands.stats import watch
from .commands.tables import add_table_commands, run_client_command
from .config import load
from .store.schema.errors import ConfigError

if TYPE_CHECKING:  # the server's modules load only for `serve`
    from .app import ExpbufServer

log = logging.getLogger("expbuf")


def _serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT, then stop accepting, finish in-flight RPCs and commit."""
    try:
        overrides = {
            "data": args.data,
            "host": args.host,
            "port": args.port,
            "metrics_port": args.metrics_port,
            "metrics_host": args.metrics_host,
            "ingest_processes": args.ingest_processes,
            "torch_threads": args.torch_threads,
            "advantage_worker": args.advantage_worker,
            "push_stream_idle_seconds": args.push_stream_idle_seconds,
            "push_stream_window": args.push_stream_window,
            "max_wait_seconds": args.max_wait_seconds,
            "max_inflight_bytes": args.max_inflight_bytes,
            "max_push_bytes": args.max_push_bytes,
            "max_metadata_bytes": args.max_metadata_bytes,
            "check_at_open": args.check_at_open,
            "scrub_mb_per_second": args.scrub_mb_per_second,
            "scrub_interval_seconds": args.scrub_interval_seconds,
        }
        config = load(args.config, overrides | {"log_format": args.log_format, "shard": args.shard})
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        return 2
    logs.configure(config.log_format)
    from .rpc.push.inflight import few_arenas

    few_arenas()  # before torch and gRPC start their threads, each of which could take an arena
    from .app import ExpbufServer, StartupError

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = ExpbufServer(config).start()
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 2
    while not stop.wait(0.5):  # a timed wait: a signal taken by another thread still reaches its handler
        if server.broken is not None:
            log.error("stopping: the store can take no more writes (%s); start the server again", server.broken)
            server.stop()
            return _stopped(server, 3)
    log.info("shutting down: no new RPCs; finishing those in flight")
    server.stop()
    return _stopped(server, 0)


def _stopped(server: ExpbufServer, code: int) -> int:
    """`code`, for a server stopped; or, where torch's import is still under way on the advantage
    worker's thread (a stop never waits for it: a stuck import must not hold it), the process
    ended at once with it: the interpreter's exit, running torch's C++ destructors beside that
    import, died of SIGABRT ("terminate called without an active exception") after the stop had
    committed everything, and an exit code 134 reads as a crash to a supervisor."""
    if not server.advantages.loading:
        return code
    log.info("torch's import still under way: the process ends without waiting for it")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _tls(args: argparse.Namespace) -> Tls | None:
    """TLS for a client command: on with --tls or a CA; a client pair for mutual TLS."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    for name in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, name)
        if path and not Path(path).is_file():
            raise CommandError(f"--{name.replace('_', '-')} {path!r}: no such file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CommandError("mutual TLS needs both --tls-cert and --tls-key")
    tls = Tls(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        tls.credentials()  # each file holds a PEM block of its kind
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return tls


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING to the standard gRPC health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = _tls(args)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    # the name the server's certificate is checked against, where it is not the target's host (127.0.0.1 in a container)
    named = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    if args.tls_server_name and not tls:
        raise CommandError("--tls-server-name names the server's certificate: it needs TLS (--tls or --tls-ca)")
    channel = grpc.secure_channel(args.target, tls.credentials(), named) if tls else grpc.insecure_channel(args.target)
    try:
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # types-grpcio-health-checking's HealthStub leaves out its methods.
            reply = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=args.timeout, metadata=metadata
            )
    except grpc.RpcError as exc:
        error = call_error(exc, tls, args.target)
        print(f"{args.target}: {error.code.name}: {error.details or 'no details'}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _stats(args: argparse.Namespace) -> int:
    return watch(args.target, args.token, args.watch, args.count, tls=_tls(args))


def _client_command(args: argparse.Namespace) -> int:
    return run_client_command(args, _tls(args))


def _export(args: argparse.Namespace) -> int:
    return run_export(args, _tls(args))


def _target(value: str) -> str:
    """A --target as a client takes it (HOST:PORT), or the line saying what to change."""
    try:
        return checked_target(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _token(value: str) -> str | None:
    """A --token as a client sends it (its whitespace left out), or the line saying why it cannot be sent."""
    try:
        return checked_token(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (--token or EXPBUF_TOKEN)") from None


# The longest --watch or --timeout: 30 days (a deadline past gRPC's clock failed at once, DEADLINE_EXCEEDED).
_MOST_SECONDS = 30 * 86_400


def _seconds(value: str) -> float:
    """A number of seconds above 0 and at most _MOST_SECONDS (a --watch or --timeout), or the line saying so."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= _MOST_SECONDS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0 and at most {_MOST_SECONDS}")
    return seconds


def _client_options(parser: argparse.ArgumentParser) -> None:
    """Where and how a client command reaches the server; the environment supplies the defaults."""
    env = os.environ.get
    default_target = env("EXPBUF_TARGET") or f"127.0.0.1:{env('EXPBUF_PORT') or 50051}"
    parser.add_argument(
        "--target", type=_target, default=default_target, help="HOST:PORT (env EXPBUF_TARGET; default %(default)s)"
    )
    parser.add_argument("--token", type=_token, default=env("EXPBUF_TOKEN"), help="a bearer token (env EXPBUF_TOKEN)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    tls_ca = "CA of the server's certificate; turns TLS on (env EXPBUF_TLS_CA)"
    parser.add_argument("--tls-ca", default=env("EXPBUF_TLS_CA"), help=tls_ca)
    tls_cert = "client certificate for mutual TLS (env EXPBUF_TLS_CLIENT_CERT)"
    parser.add_argument("--tls-cert", default=env("EXPBUF_TLS_CLIENT_CERT"), help=tls_cert)
    parser.add_argument("--tls-key", default=env("EXPBUF_TLS_CLIENT_KEY"), help="its key (env EXPBUF_TLS_CLIENT_KEY)")


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, each with its help text."""
    parser = argparse.ArgumentParser(prog="expbuf", description="Durable experience buffer for RL fine-tuning")
    parser.add_argument("--version", action="version", version=f"expbuf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, help="what to do")
    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--data", help="LMDB directory (default ./expbuf-data; env EXPBUF_DATA)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; env EXPBUF_HOST)")
    serve.add_argument("--port", type=int, help="gRPC port, 0 picks a free one (default 50051; env EXPBUF_PORT)")
    metrics_port = "Prometheus port, 0 picks a free one, -1 = off (default 9400; env EXPBUF_METRICS_PORT)"
    serve.add_argument("--metrics-port", type=int, help=metrics_port)
    serve.add_argument(
        "--metrics-host", help="address of the metrics endpoint (default: the --host one; env EXPBUF_METRICS_HOST)"
    )
    serve.add_argument(
        "--ingest-processes",
        type=int,
        help="processes that validate and pack pushes, 0 = none (default: cores - 1, at most 4;"
        " env EXPBUF_INGEST_PROCESSES)",
    )
    serve.add_argument(
        "--torch-threads",
        type=int,
        help="torch's threads for the server's advantages, 0 = torch's default (default 1; env EXPBUF_TORCH_THREADS)",
    )
    serve.add_argument(
        "--advantage-worker",
        choices=("when_needed", "at_start"),
        help="load torch and start the advantage worker once a table needs advantages computed, or at the start"
        " (default when_needed; env EXPBUF_ADVANTAGE_WORKER)",
    )
    serve.add_argument(
        "--push-stream-idle-seconds",
        type=float,
        help="end a PushStream that sends nothing this long (default 120; env EXPBUF_PUSH_STREAM_IDLE_SECONDS)",
    )
    serve.add_argument(
        "--push-stream-window",
        type=int,
        help="pushes a PushStream reads and stores ahead of its replies (default 8; env EXPBUF_PUSH_STREAM_WINDOW)",
    )
    serve.add_argument(
        "--max-wait-seconds",
        type=float,
        help="the longest a Sample batch or an Admit waits for data or room (default 600; env EXPBUF_MAX_WAIT_SECONDS)",
    )
    serve.add_argument(
        "--max-inflight-bytes",
        type=int,
        help="payload bytes pushes and PutValues in progress may hold; past it they wait, then are refused"
        " (default 1 GiB; env EXPBUF_MAX_INFLIGHT_BYTES)",
    )
    serve.add_argument(
        "--max-push-bytes",
        type=int,
        help="the largest push in chunks; a larger one is refused at its first chunk"
        " (default 16 GiB; env EXPBUF_MAX_PUSH_BYTES)",
    )
    serve.add_argument(
        "--max-metadata-bytes",
        type=int,
        help="the most an experience's metadata may take written out; a push with more is refused"
        " (default 8 MiB; env EXPBUF_MAX_METADATA_BYTES)",
    )
    serve.add_argument(
        "--check-at-open",
        choices=("quick", "full"),
        help="before serving, check the directory's structure (quick, the default: reads check what they"
        " serve, the scrub the rest) or every record and digest (full; about 3 GB/s) (env EXPBUF_CHECK_AT_OPEN)",
    )
    serve.add_argument(
        "--scrub-mb-per-second",
        type=float,
        help="the background check of every payload after the start reads at most this many MB/s, 0 turns it off"
        " (default 32; env EXPBUF_SCRUB_MB_PER_SECOND)",
    )
    serve.add_argument(
        "--scrub-interval-seconds",
        type=float,
        help="a scrub pass begins this long after the last began (default 86400; env EXPBUF_SCRUB_INTERVAL_SECONDS)",
    )
    serve.add_argument("--config", help="TOML file with settings, TLS, tokens and tables")
    serve.add_argument("--shard", help="this server's shard name, a label on its metrics (env EXPBUF_SHARD)")
    serve.add_argument(
        "--log-format", choices=("text", "json"), help="log lines as text (default) or JSON (env EXPBUF_LOG_FORMAT)"
    )
    serve.set_defaults(func=_serve)
    stats = sub.add_parser("stats", help="show a running server's tables (counts by state, rates, ages)")
    _client_options(stats)
    stats.add_argument("--watch", type=_seconds, nargs="?", const=2.0, default=0.0, metavar="SECONDS",
                       help="refresh every SECONDS (default 2) until Ctrl-C")  # fmt: skip
    stats.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    stats.set_defaults(func=_stats)
    health = sub.add_parser("health", help="standard gRPC health check (for container health checks)")
    _client_options(health)
    health.add_argument(
        "--timeout", type=_seconds, default=3.0, help="seconds to wait for the answer (default %(default)s)"
    )
    health.add_argument(
        "--tls-server-name",
        default=os.environ.get("EXPBUF_TLS_SERVER_NAME"),
        help="a name the server's certificate holds, checked in place of the target's host"
        " (env EXPBUF_TLS_SERVER_NAME; a container's check reaches 127.0.0.1)",
    )
    health.set_defaults(func=_health)
    add_table_commands(sub, _client_options, _client_command)
    add_dataset_commands(sub, _client_options, _client_command)
    add_export_command(sub, _client_options, _export)
    add_datadir_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a command's positionals at its first option: `table create t --exist-ok
    # group_size=8` leaves the settings over. Settings may come before, between or after options.
    if extra and isinstance(getattr(args, "settings", None), list) and not any(a.startswith("-") for a in extra):
        args.settings += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logs.configure()
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"expbuf {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # its output's reader left (`expbuf export t | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 1


if __name__ == "__main__":
    sys.exit(main())
