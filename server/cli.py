"""The `expbuf` command line: serve a data directory, check its integrity."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .app import ExpbufServer
from .config import load
from .store import Store
from .tables import ConfigError

log = logging.getLogger("expbuf")


def _serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT, then stop accepting, finish in-flight RPCs and commit."""
    try:
        config = load(
            args.config,
            {"data": args.data, "host": args.host, "port": args.port, "metrics_port": args.metrics_port},
        )
    except ConfigError as exc:
        log.error("configuration: %s", exc)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ExpbufServer(config).start()
    stop.wait()
    log.info("shutting down: no new RPCs; finishing those in flight")
    server.stop()
    return 0


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
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check", help="verify a data directory (the server must be stopped)")
    check.add_argument("--data", default="./expbuf-data")
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
