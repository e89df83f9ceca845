"""The `expbuf` command line: serve a data directory, check its integrity."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from . import logs
from .app import ExpbufServer
from .config import load
from .stats_view import watch
from .store import Store
from .tables import ConfigError

log = logging.getLogger("expbuf")


def _serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT, then stop accepting, finish in-flight RPCs and commit."""
    try:
        overrides = {"data": args.data, "host": args.host, "port": args.port, "metrics_port": args.metrics_port}
        config = load(args.config, overrides | {"log_format": args.log_format, "shard": args.shard})
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        return 2
    logs.configure(config.log_format)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ExpbufServer(config).start()
    stop.wait()
    log.info("shutting down: no new RPCs; finishing those in flight")
    server.stop()
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING to the standard gRPC health check."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.target}: {exc.code().name}", file=sys.stderr)
        return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _check(args: argparse.Namespace) -> int:
    """Verify every table's indexes and counters against its items."""
    with Store(args.data) as store:
        bad = 0
        for config in store.list_tables():
            problems = store.verify(config.name)
            bad += len(problems)
            print(f"{config.name}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
            for problem in problems:
                print(f"  {problem}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="expbuf", description="Durable experience buffer for RL fine-tuning")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gRPC server")
    serve.add_argument("--data", help="LMDB directory (default ./expbuf-data; env EXPBUF_DATA)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; env EXPBUF_HOST)")
    serve.add_argument("--port", type=int, help="gRPC port, 0 picks a free one (default 50051; env EXPBUF_PORT)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port, 0 = off (default 9400)")
    serve.add_argument("--config", help="TOML file with settings, TLS, tokens and tables")
    serve.add_argument("--shard", help="this server's shard name, a label on its metrics (env EXPBUF_SHARD)")
    serve.add_argument("--log-format", choices=("text", "json"), help="log lines as text (default) or JSON")
    serve.set_defaults(func=_serve)
    stats = sub.add_parser("stats", help="show a running server's tables (counts by state, rates, ages)")
    stats.add_argument("--target", default="127.0.0.1:50051")
    stats.add_argument("--token", default=None, help="a bearer token with the sample scope")
    stats.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, metavar="SECONDS",
                       help="refresh every SECONDS (default 2) until Ctrl-C")  # fmt: skip
    stats.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    stats.set_defaults(func=lambda a: watch(a.target, a.token, a.watch, a.count))
    health = sub.add_parser("health", help="standard gRPC health check (for container health checks)")
    health.add_argument("--target", default="127.0.0.1:50051")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)
    check = sub.add_parser("check", help="verify a data directory (the server must be stopped)")
    check.add_argument("--data", default="./expbuf-data")
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    logs.configure()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
