"""The metrics endpoint needs no token: no client of it may harm the gRPC service
(server/metrics_http.py). A real server in the test's process, its metrics on a free port."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import urllib.request

import pytest

from expbuf.client import BufferClient
from expbuf.server import metrics_http

from conftest import Servers
from helpers import make_experience, scrape, wait_for


def scraped(port: int) -> bool:
    """Whether a scrape was answered whole (a connection closed past the endpoint's cap: False)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    except OSError:
        return False
    return b"expbuf_tables" in body


def test_idle_connections_and_a_scrape_storm_leave_the_service_whole(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle connections to the metrics port pinned a thread and a descriptor each, for good (1,000
    of them and new gRPC clients could not connect), and 130 scrapes at once took every LMDB
    reader slot: gRPC calls failed INTERNAL, MDB_READERS_FULL (a helper's audit). At most
    MAX_CONNECTIONS are served at once, an idle one is closed, scrapes run one at a time."""
    monkeypatch.setattr(metrics_http._Quiet, "timeout", 1.0)  # IDLE_SECONDS, short for the test
    server = start_server()
    target, port = f"127.0.0.1:{server.port}", server.metrics_port
    before = threading.active_count()
    idle = []
    for _ in range(100):
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
        idle.append(connection)
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= metrics_http.MAX_CONNECTIONS + 1
        with BufferClient(target, timeout=10) as client:
            client.create_table("t", group_size=1)
            assert client.stats("t")["t"].pushed == 0
        wait_for(lambda: scraped(port), "a scrape answered once the idle connections were closed", seconds=30)
    finally:
        for connection in idle:
            connection.close()
    with (
        BufferClient(target, timeout=10) as client,
        concurrent.futures.ThreadPoolExecutor(max_workers=150) as pool,
    ):
        storm = [pool.submit(scraped, port) for _ in range(300)]
        for _ in range(30):  # each a read of every table's counters, as a scrape is
            assert client.stats("t")["t"].pushed == 0
        answered = [future.result() for future in storm]
    assert any(answered)
    assert ("expbuf_tables", ()) in scrape(port)


@pytest.mark.parametrize("shard", ["", "s0"])
def test_a_scrape_that_names_the_metrics_it_wants_gets_the_stores_too(start_server: Servers, shard: str) -> None:
    """`?name[]=` (Prometheus's federation, an operator's curl) got none of the store's metrics
    (their collector told the registry no names) and, on a shard, none at all."""
    server = start_server(shard=shard)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.stats("default")
    wanted = ("expbuf_buffer_experiences", "expbuf_storage_bytes", "expbuf_rpc_duration_seconds_count")
    query = "&".join(f"name[]={name}" for name in wanted)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics?{query}", timeout=10).read()
    series = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
    assert {line.split("{")[0].split(" ")[0] for line in series} == set(wanted), series
    if shard:
        assert all(f'shard="{shard}"' in line for line in series), series


def test_the_storage_in_use_comes_down_as_experiences_are_consumed(start_server: Servers) -> None:
    """expbuf_storage_bytes counted the data file up to LMDB's last page, which only grows: after a
    drain, the runbook's own advice, ExpbufStorageNearlyFull and the dashboard's room stayed where
    they were (a helper's audit: 24 MiB pushed, 24 MiB once all was consumed). It counts the pages in
    use, as the pushes' room does; the high-water mark is expbuf_storage_file_bytes."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        client.create_table("t", group_size=1, estimator="none")
        client.push([make_experience(1, task, 0, response=64 << 10) for task in range(32)], table="t")
        full = scrape(server.metrics_port)
        for _ in client.sample("t", num_groups=32, max_batches=1, delivery="consume", timeout=30):
            pass
        client.push([make_experience(2, 0, 0)], table="t")  # a commit after the drain's: its freed pages counted
        drained = scrape(server.metrics_port)
    in_use, mark = ("expbuf_storage_bytes", ()), ("expbuf_storage_file_bytes", ())
    assert full[in_use] > 4 * drained[in_use], (full[in_use], drained[in_use])
    assert drained[mark] >= full[mark] >= full[in_use]
