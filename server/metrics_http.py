"""The Prometheus metrics endpoint, bounded so that no client of it can harm the gRPC service.

The port needs no token: whoever reaches it may scrape. prometheus_client's own server starts a
thread per connection and waits on each without a timeout, and every scrape reads each table's
counters in read transactions of its own. So 130 scrapes at once took every LMDB reader slot
(gRPC calls failed INTERNAL, MDB_READERS_FULL, the advantage worker retried), and 1,000 idle
connections pinned as many threads and descriptors until new gRPC clients could not connect.
Here a scrape is made one at a time (the others wait their turn), at most MAX_CONNECTIONS are
served at once (one more is closed at once), a connection that sends nothing for IDLE_SECONDS is
closed, and what wsgiref would print to stderr goes to the log at debug level.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("expbuf")
MAX_CONNECTIONS = 16  # served at once; Prometheus scrapes over one or two
IDLE_SECONDS = 10.0  # a connection that sends nothing for this long is closed


class _Quiet(WSGIRequestHandler):
    """A handler that logs no request, and times out a connection idle IDLE_SECONDS."""

    timeout = IDLE_SECONDS  # StreamRequestHandler.setup sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:  # wsgiref's name
        """Nothing: a scrape is not an event."""

    def get_stderr(self) -> Any:
        return _LogWriter()


class _LogWriter:
    """wsgiref's error stream (a client gone mid-reply), to the log at debug level, not stderr."""

    def write(self, text: str) -> None:
        if text.strip():
            log.debug("metrics endpoint: %s", text.rstrip())

    def flush(self) -> None:
        return None


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A WSGI server of at most MAX_CONNECTIONS connections at once, each on a thread of its own."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = (
        128  # connections the kernel holds until accepted: one past the cap is closed, not left to retry
    )

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # as many served already: this one is closed
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics endpoint: a connection from %s failed", client_address, exc_info=True)


def one_at_a_time(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """`app` answering one request at a time: a scrape's collection reads every table's counters."""
    lock = threading.Lock()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with lock:
            return list(app(environ, start_response))

    return serve


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> MetricsServer:
    """Serve `registry` on host:port (0: a free port) on a thread of its own; OSError where it
    cannot bind."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Bound(MetricsServer):
        address_family = family

    server = make_server(host, port, one_at_a_time(make_wsgi_app(registry)), Bound, handler_class=_Quiet)
    assert isinstance(server, MetricsServer)
    threading.Thread(target=server.serve_forever, name="expbuf-metrics", daemon=True).start()
    return server
