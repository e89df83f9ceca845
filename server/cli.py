"""The `expbuf` command line: serve a data directory, check its integrity."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .store import Store

log = logging.getLogger("expbuf")


def _serve(args: argparse.Namespace) -> int:
    """Open the store and keep its maintenance (lease expiry, group timeouts) running.

    The gRPC service is not part of this build yet: this runs the storage engine
    alone, so that `expbuf serve` already owns and maintains its data directory.
    """
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Store(args.data) as store:
        tables = ", ".join(t.name for t in store.list_tables())
        log.info("expbuf storage open at %s (tables: %s); the gRPC service is not in this build", args.data, tables)
        while not stop.wait(0.5):
            store.tick()
        log.info("shutting down: queued writes committed")
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
    data_default = os.environ.get("EXPBUF_DATA", "./expbuf-data")
    serve = sub.add_parser("serve", help="run the buffer on a data directory")
    serve.add_argument("--data", default=data_default, help="LMDB directory (default ./expbuf-data, env EXPBUF_DATA)")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check", help="verify a data directory (the server must be stopped)")
    check.add_argument("--data", default=data_default)
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
