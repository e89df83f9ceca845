"""Operations: Prometheus metrics scraped over HTTP, logs, `expbuf stats`, the docker files."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import fnmatch
import importlib.metadata
import importlib.resources
import io
import json
import logging
import logging.handlers
import os
import queue
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, ServerInfo, TableStats, trxp
from expbuf.client.client import GetResult
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server import logs
from expbuf.server.advantages.worker import estimators
from expbuf.server.app import _by_table, _summary
from expbuf.server.cli import build_parser
from expbuf.server.commands.stats import COLUMNS, rates_between, render
from expbuf.server.config import ServerConfig, load
from expbuf.server.rpc.interceptors.limits import CallLimits, call_limits
from expbuf.server.rpc.interceptors.metrics import Metrics
from expbuf.server.rpc.interceptors.store_metrics import StoreCollector
from expbuf.server.rpc.service import ExperienceBufferService
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.estimator_registry import Estimator
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

import cli_forks
from conftest import BAD_DIR, Servers, payload
from helpers import ServerProcess, group_items, registered, scrape, wait_for
from pages import page

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_metrics_after_a_known_workload(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=20) as c:
        c.push(payload("grpo_group.trxp"))  # 8 experiences, model_version 5
        c.push(payload("mixed_batch.trxp"))  # 2 groups of 4, model_version 1
        c.push(payload("grpo_group.trxp"))  # 8 duplicates
        with pytest.raises(BufferError):
            c.push((BAD_DIR / "missing_eid.bin").read_bytes())
        c.create_table("dapo", drop_zero_variance=True)
        c.push(trxp.build(group_items(1, 0, 4, reward=1.0)), table="dapo")  # dropped: zero variance
        c.create_table("ring", estimator="none", capacity_experiences=4, when_full="evict")
        c.push(trxp.build(group_items(2, 0, 4)), table="ring")
        c.push(trxp.build(group_items(2, 1, 4)), table="ring")  # evicts the first group
        wait_until(lambda: c.stats()["default"].ready == 16)
        consumed = next(c.sample(num_groups=1, max_batches=1, delivery="consume"))  # 7/3, version 5
        leased = next(c.sample(num_groups=1, delivery="lease", lease_seconds=0.5, max_batches=1))  # 11/0, v1
        assert (consumed.groups[0], leased.groups[0]) == ("7/3", "11/0")
        wait_until(lambda: c.stats()["default"].leases_expired == 1)
    m = scrape(server.metrics_port)
    d = {"table": "default"}
    assert value(m, "expbuf_experiences_pushed_total", **d) == 16
    assert value(m, "expbuf_duplicates_total", **d) == 8
    assert value(m, "expbuf_experiences_sampled_total", **d) == 12
    sampled_bytes = sum(len(trxp.pack_item(i)) for i in trxp.parse(payload("grpo_group.trxp")))
    sampled_bytes += sum(len(trxp.pack_item(i)) for i in trxp.parse(payload("mixed_batch.trxp"))[:4])
    assert value(m, "expbuf_bytes_sampled_total", **d) == sampled_bytes
    assert value(m, "expbuf_bytes_pushed_total", **d) > sampled_bytes
    assert value(m, "expbuf_refused_total", table="default", reason="invalid_payload") == 1
    assert value(m, "expbuf_leases_expired_total", **d) == 1
    assert value(m, "expbuf_evicted_total", table="ring") == 4
    assert value(m, "expbuf_groups_dropped_total", table="dapo", reason="zero_variance") == 1
    states = {s: value(m, "expbuf_buffer_experiences", table="default", state=s) for s in
              ("pending", "computing", "ready", "leased", "consumed")}  # fmt: skip
    assert states == {"pending": 0, "computing": 0, "ready": 8, "leased": 0, "consumed": 8}
    assert value(m, "expbuf_groups", table="default", state="ready") == 2
    assert value(m, "expbuf_rpc_duration_seconds_count", method="Push", code="OK") == 6
    assert value(m, "expbuf_rpc_duration_seconds_count", method="Push", code="INVALID_ARGUMENT") == 1
    assert value(m, "expbuf_advantage_seconds_count", table="default", estimator="grpo") >= 1
    # staleness: newest version 5; 8 experiences of version 5 and 4 of version 1 were sampled
    assert value(m, "expbuf_sample_staleness_versions_count", **d) == 12
    assert value(m, "expbuf_sample_staleness_versions_sum", **d) == 16
    assert (
        value(
            m,
            "expbuf_storage_bytes",
        )
        > 0
    )
    assert 0 < value(m, "expbuf_lmdb_map_used_ratio") < 1
    server.stop(grace=1)
    server = start_server()  # gauges and store totals come back from LMDB, not from zero
    again = scrape(server.metrics_port)
    for name, labels in (
        ("expbuf_experiences_pushed_total", d),
        ("expbuf_buffer_experiences", {"table": "default", "state": "ready"}),
        ("expbuf_buffer_experiences", {"table": "default", "state": "consumed"}),
        ("expbuf_groups_dropped_total", {"table": "dapo", "reason": "zero_variance"}),
    ):
        assert value(again, name, **labels) == value(m, name, **labels)


@pytest.mark.parametrize("storage", ["rows", "records"])
def test_the_evicted_and_failed_totals_stay_once_their_tombstones_are_forgotten(tmp_path: Path, storage: str) -> None:
    """Stats.evicted is a total since the table was created, as expbuf_evicted_total is: it was the
    count of evicted tombstones, and fell to 0 as they were forgotten. Failed groups are counted by
    expbuf_groups_failed_total; expbuf_groups{state="failed"}, a gauge that only grows, stays for
    this release (a helper's audit)."""
    from test_store import Clock

    clock = Clock()
    config = TableConfig.of(
        "t", estimator="none", group_size=2, layout=storage, tombstone_seconds=10, capacity_experiences=4,
        when_full="evict",
    )  # fmt: skip
    with Store(tmp_path / "data", clock=clock) as store:
        store.create_table(config)
        store.put("t", group_items(0, 0, 2, reward=0.0))
        key = layout.table_prefix(store.catalog.lookup("t")[0]) + b"0/0/1/0/r1s0"

        def damage(txn: Any) -> None:
            stored = bytearray(txn.get(key, db=store.db["blobs"]))
            stored[-1] ^= 0xFF
            txn.put(key, bytes(stored), db=store.db["blobs"])

        store.environment.submit(damage)
        store.get_payload("t", ["0/0/1/0/r1s0"])  # read, found damaged: quarantined, its group failed
        for task in (1, 2, 3):
            store.put("t", group_items(0, task, 2, reward=0.0))  # capacity 4 beside the failed group: one evicted
        service = ExperienceBufferService(store, metrics=Metrics(store), max_message_bytes=1 << 20,
                                          advantage_device="cpu")  # fmt: skip
        before = service._table_stats("t").evicted
        clock.now += 60
        store.tick()  # the tombstones, 10 s old, are forgotten (a rows table's with their segment)
        assert before == service._table_stats("t").evicted == 2
        collected = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in StoreCollector(store).collect()
            for sample in family.samples
        }
        assert value(collected, "expbuf_evicted_total", table="t") == 2
        assert value(collected, "expbuf_groups_failed_total", table="t") == 1


def test_the_sampled_counters_count_batches_delivered_and_never_go_down(
    start_server: Servers, table_layout: str
) -> None:
    """A trainer's sample() with batches sent ahead that it leaves after one: the two sent ahead
    go back unconfirmed. They were counted as sampled at their take and taken out of the counters
    at the give-back, so Prometheus saw its counters go down (read as a reset: rate() spikes), and
    the staleness histogram counted them as they went out. Now a batch held for a stream counts
    once its client confirms it has it, and a give-back has nothing to take out."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("t", estimator="none")
        c.push(trxp.build([item for task in range(4) for item in group_items(1, task, 1)]), table="t")
        batches = c.sample("t", num_groups=1, window=2, timeout=20, delivery="consume")
        first = next(batches)
        wait_until(lambda: c.stats("t")["t"].ready == 1)  # two more sent ahead, held
        seen = [scrape(server.metrics_port)]
        batches.close()  # they go back
        seen.append(scrape(server.metrics_port))
        stats = c.stats("t")["t"]
    assert (stats.sampled, stats.consumed, stats.ready) == (1, 1, 3), stats
    size = len(trxp.pack_item(trxp.parse(first.payload)[0]))
    for name, delivered in (
        ("expbuf_experiences_sampled_total", 1),
        ("expbuf_bytes_sampled_total", size),
        ("expbuf_sample_staleness_versions_count", 1),
    ):
        values = [value(m, name, table="t") for m in seen]
        assert values == [delivered, delivered], (name, values)


def test_a_dropped_table_leaves_no_series_and_a_new_one_of_its_name_starts_from_zero(start_server: Servers) -> None:
    """Every per-table series goes with its table: those the server counts itself (refusals,
    admissions, staleness, advantage time) as those read from the store. Else a scrape grows with
    every table ever made (one per run), and a table made again under the name inherits the old one's."""
    server = start_server()

    def series() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {key for key in scrape(server.metrics_port) if ("table", "run1") in key[1]}

    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("run1", group_size=4)
        c.push(trxp.build(group_items(1, 0, 4)), table="run1")
        wait_until(lambda: c.stats()["run1"].ready == 4)
        next(c.sample(num_groups=1, max_batches=1, table="run1", delivery="consume", timeout=10))
        c.admit("run1", 1)
        with pytest.raises(BufferError):
            c.push((BAD_DIR / "bad_magic.bin").read_bytes(), table="run1")
        names = {name for name, _ in series()}
        assert {"expbuf_refused_total", "expbuf_admit_requests_total", "expbuf_advantage_seconds_count",
                "expbuf_sample_staleness_versions_count", "expbuf_experiences_pushed_total"} <= names  # fmt: skip
        c.drop_table("run1")
        assert series() == set()
        c.create_table("run1", estimator="none", group_size=4)
        c.push(trxp.build(group_items(2, 0, 4)), table="run1")
        m = scrape(server.metrics_port)
    assert value(m, "expbuf_experiences_pushed_total", table="run1") == 4
    assert not {name for name, _ in series()} & {"expbuf_refused_total", "expbuf_advantage_seconds_count"}


def test_a_computation_in_flight_as_its_table_is_dropped_brings_back_none_of_its_series(
    start_server: Servers,
) -> None:
    """A push's groups whose advantages the worker still computed as their table was dropped
    timed the computation, and counted its failure to store them, for the dropped table after
    the drop had removed its series: they came back in every scrape until a restart (and went on
    under a table made again of the name). What a call in flight records for a table dropped
    meanwhile is left out."""
    computing, dropped = threading.Event(), threading.Event()

    def held(b: estimators.FlatBatch) -> estimators.Advantages:
        computing.set()
        assert dropped.wait(60)  # the test's drop is done
        return estimators.Advantages(scalar=b.rewards - b.rewards)

    server = start_server()
    slow = Estimator("held_until_dropped", ingest=held, token_level=True)  # the worker's, never a push's
    with registered(slow) as name, BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        for table in ("run1", "run2"):
            c.create_table(table, group_size=2, estimator=name)
        c.push(trxp.build(group_items(1, 0, 2)), table="run1")
        assert computing.wait(60)
        c.drop_table("run1")
        dropped.set()
        c.push(trxp.build(group_items(2, 0, 2)), table="run2")
        wait_for(lambda: c.stats("run2")["run2"].ready == 2, "run2's group computed, after run1's")
        left = {key for key in scrape(server.metrics_port) if ("table", "run1") in key[1]}
    assert left == set()


@pytest.mark.parametrize("outcome", ["computed", "raised"])
def test_a_computation_in_flight_as_its_table_is_made_again_counts_nothing_for_the_new_one(
    start_server: Servers, outcome: str
) -> None:
    """A table dropped and made again under its name while the worker computed the old one's group:
    the late computation's time, or its failure, was counted for the new table, which the drop had
    left with no series: `expbuf_advantage_seconds_count` said two computations where it had one,
    and `expbuf_advantage_failures_total` a failure of a group it never held. What the worker
    records is now its table's, by the table's id, not its name."""
    computing, made_again = threading.Event(), threading.Event()
    old = [True]

    def held(b: estimators.FlatBatch) -> estimators.Advantages:
        if old.pop() if old else False:
            computing.set()
            assert made_again.wait(60)
            if outcome == "raised":
                raise RuntimeError("a fault that may pass")
        return estimators.Advantages(scalar=b.rewards - b.rewards)

    server = start_server()
    slow = Estimator("held_until_made_again", ingest=held, token_level=True)  # the worker's, never a push's
    with registered(slow) as name, BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("run1", group_size=2, estimator=name)
        c.push(trxp.build(group_items(1, 0, 2)), table="run1")
        assert computing.wait(60)
        c.drop_table("run1")
        c.create_table("run1", group_size=2, estimator=name)
        made_again.set()
        c.push(trxp.build(group_items(2, 0, 2)), table="run1")
        wait_for(lambda: c.stats("run1")["run1"].ready == 2, "the new run1's group computed, after the old one")
        m = scrape(server.metrics_port)
    counted = {
        key[0]: got
        for key, got in m.items()
        if ("table", "run1") in key[1]
        and key[0] in ("expbuf_advantage_seconds_count", "expbuf_advantage_failures_total")
    }
    assert counted == {"expbuf_advantage_seconds_count": 1}


def test_a_scrape_during_which_a_table_is_dropped_leaves_it_out(tmp_path: Path) -> None:
    """The collector lists the tables, then reads each: a table dropped between the two (a job's
    end while Prometheus scrapes) is left out of that scrape, which answered HTTP 500 instead."""
    with Store(tmp_path / "data") as store:
        for name in ("kept", "gone"):
            store.create_table(TableConfig.of(name=name, estimator="none", group_size=1))
            store.put(name, group_items(name, 0, 1))
        collected = StoreCollector(store).collect()
        assert next(collected).name == "expbuf_tables"  # the tables are listed
        store.drop_table("gone")
        pushed = {
            s.labels["table"]: s.value for m in collected if m.name == "expbuf_experiences_pushed" for s in m.samples
        }
    assert pushed == {"default": 0, "kept": 1}


def test_stats_of_every_table_leaves_out_one_dropped_while_it_reads(tmp_path: Path) -> None:
    """The Stats call without a table (`expbuf stats --watch`) lists the tables, then reads each: a
    table dropped between the two is left out, where the call was refused NOT_FOUND for a table
    its caller never named, ending the watch."""

    class DroppedAfterListing(Store):
        def list_tables(self) -> list[Any]:
            listed = super().list_tables()
            if any(table.name == "gone" for table in listed):
                self.drop_table("gone")
            return listed

    with DroppedAfterListing(tmp_path / "data") as store:
        for name in ("kept", "gone"):
            store.create_table(TableConfig.of(name=name, estimator="none", group_size=1))
            store.put(name, group_items(name, 0, 1))
        service = ExperienceBufferService(store, metrics=Metrics(store), max_message_bytes=1 << 20,
                                          advantage_device="cpu")  # fmt: skip
        reply = service.Stats(pb.StatsRequest(), None)
        assert not store.has_table("gone")
    assert {t.name: t.ready for t in reply.tables} == {"default": 0, "kept": 1}


def test_dashboard_queries_use_exported_metrics(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as c:
        c.push(payload("grpo_group.trxp"))
        next(c.sample(num_groups=1, max_batches=1, timeout=10, delivery="consume"))
        c.set_trainer_version(1)
        c.admit("default", 1)
        c.create_dataset("default", "prompts", 4)  # the ledger's series: a table's datasets
        with pytest.raises(BufferError):  # refusals are counted from the first one on
            c.push((BAD_DIR / "bad_magic.bin").read_bytes())
    samples = scrape(server.metrics_port)
    exported = {name for name, _ in samples}
    by_table = {name for name, labels in samples if "table" in dict(labels)}
    dashboard = json.loads((DOCKER / "grafana" / "expbuf.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\bexpbuf_[a-z_]+", expr)}
    assert len(exprs) >= 10 and len(used) >= 10
    assert used <= exported, f"the dashboard queries metrics the server does not export: {used - exported}"
    # Both variables narrow every panel: each selector names the shard, and the table where the metric has one.
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["shard", "table"]
    for expr in exprs:
        for name, selector in re.findall(r"\b(expbuf_[a-z_]+)\{([^}]*)\}", expr):
            assert 'shard=~"$shard"' in selector, expr
            assert ('table=~"$table"' in selector) == (name in by_table), expr


def test_json_logs_and_stats_view(tmp_path: Path) -> None:
    proc = ServerProcess(str(tmp_path), "--log-format", "json")
    try:
        with BufferClient(proc.target) as c:
            c.push(payload("grpo_group.trxp"))
            with pytest.raises(BufferError):
                c.push((BAD_DIR / "pickle_global.bin").read_bytes())
            c.create_table("extra", estimator="none")
        command = ["stats", "--target", proc.target, "--watch", "0.2", "--count", "2"]
        out = subprocess.run(
            [sys.executable, "-m", "expbuf.server.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        code = proc.stop(signal.SIGTERM)
        assert code == 0, f"exit code {code}; the server's log ends:\n" + "".join(proc.log[-40:])
    lines = [json.loads(line) for line in proc.log]
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    messages = [line["message"] for line in lines]
    assert any(m.startswith("expbuf listening on") for m in messages)
    assert any("table created" in m and "extra" in m for m in messages)
    assert any("refused Push" in m and "invalid_payload" in m for m in messages)
    assert any("stopped" in m for m in messages)
    assert not any("TRXP" in m or "\\x" in m for m in messages)  # no payload bytes
    assert out.count("default ") == 2 and out.count("extra ") == 2
    row = next(line for line in out.splitlines()[::-1] if line.startswith("default "))
    assert re.search(r"default\s+0\s+\d+\s+\d+\s+0\s+0\s+", row)
    assert "5..5" in row
    assert "\x1b" not in out  # into a pipe: no terminal sequences


def read_terminal(command: list[str], lines: int, columns: int, timeout: float = 60) -> str:
    """What `command` writes to a terminal (a pty) of `lines` x `columns`, until it exits."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # they would override the pty's
    child = subprocess.Popen(command, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the child's end is closed
                    break
                if not chunk:
                    break
                out += chunk
        assert child.wait(10) == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(master)
    return out.decode().replace("\r\n", "\n")  # the terminal's own line ends


def test_stats_watch_redraws_one_screen_on_a_terminal(child_server: ServerProcess) -> None:
    """On a terminal each refresh is drawn over the last, from the top (the screen is cleared
    once), every line cut to the width and the view to the height, so nothing scrolls and no
    screen piles up under another; into a pipe it is plain text (test_json_logs_and_stats_view).
    The module's shared server: other tests' tables only make the view taller."""
    with BufferClient(child_server.target) as c:
        for n in range(12):  # a view taller than the terminal
            c.create_table(f"watch{n}", estimator="none")
    command = ["stats", "--target", child_server.target, "--watch", "0.2", "--count", "3"]
    out = read_terminal([sys.executable, "-m", "expbuf.server.cli", *command], lines=12, columns=80)
    home, erase_line, erase_below, erase_screen = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"
    assert out.startswith(erase_screen + home) and out.count(erase_screen) == 1, repr(out[:200])
    frames = out.split(home)[1:]
    assert len(frames) == 3, repr(out)
    for frame in frames:
        assert frame.endswith(erase_below), repr(frame)
        lines = frame[: -len(erase_below)].split("\n")
        assert lines[-1] == "" and len(lines) - 1 <= 11, lines  # at most 11 line ends on 12 lines
        assert all(line.endswith(erase_line) and len(line) - len(erase_line) <= 80 for line in lines[:-1]), lines
        assert lines[0].startswith("expbuf ") and "more line(s)" in lines[-2], lines


def test_health_command(tmp_path: Path) -> None:
    proc = ServerProcess(str(tmp_path))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "expbuf.server.cli", "health", "--target", proc.target],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == "SERVING"
    finally:
        proc.stop(signal.SIGTERM)
    done = subprocess.run(
        [sys.executable, "-m", "expbuf.server.cli", "health", "--target", proc.target, "--timeout", "1"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 1


def test_compose_file_is_valid_for_compose() -> None:
    """The compose file's structure, checked with PyYAML: nothing to install, no engine needed."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert set(compose) <= {"services", "volumes", "networks", "configs", "secrets", "name"}
    services, volumes = compose["services"], compose.get("volumes") or {}
    assert set(services) == {"expbuf", "prometheus", "grafana"}
    build = services["expbuf"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for port in service.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", str(port)), (name, port)
        for mount in service.get("volumes", []):
            source, target, *mode = mount.split(":")
            assert target.startswith("/") and mode in ([], ["ro"]), (name, mount)
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in volumes, f"{name} uses the volume {source}, which is not declared"
        for dependency in service.get("depends_on", []):
            assert dependency in services, (name, dependency)
        assert all(isinstance(v, str) for v in (service.get("environment") or {}).values()), name
    assert services["expbuf"]["ports"] == ["50051:50051", "9400:9400"]
    # The quick start serves in seconds at any size and keeps RSS under 1 GB: the health check gives
    # it 20 s, the memory limit leaves room for 1 GiB of pushes in flight at 3x (README, Operations).
    health = services["expbuf"]["healthcheck"]
    assert health["test"] == ["CMD", "expbuf", "health"] and health["start_period"] == "20s"
    assert services["expbuf"]["mem_limit"] == "6g"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert (
        'HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 CMD ["expbuf", "health"]' in dockerfile
    )
    # Publishing on every interface without tokens is a choice the file must say out loud.
    text = (DOCKER / "compose.yaml").read_text()
    warning = text[text.index("  expbuf:") : text.index("    ports:")]
    assert "every interface" in warning and "EXPBUF_TOKENS" in warning and "127.0.0.1:50051:50051" in warning


def test_make_test_changes_nothing_on_the_system() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"apt-get|apt |sudo|dpkg", makefile), "a make target installs system packages"
    recipe = re.search(r"^test:(.*)$", makefile, re.M)
    assert recipe is not None and recipe.group(1).split() == ["setup"]


def make_dry_run(target: str, venv: Path) -> list[str]:
    """The commands `make TARGET` would run in a virtualenv at `venv` (make -n: none is run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_make_serve_installs_no_framework_and_make_test_completes_its_virtualenv(tmp_path: Path) -> None:
    """`make serve` installs what serving needs; `make test` adds the rest, also to a virtualenv that
    `make serve` set up (its stamp says only that), and installs nothing twice."""
    serve = " ".join(make_dry_run("serve", tmp_path / "fresh"))
    assert "pip install" in serve and '-e ".[native]"' in serve and "expbuf serve" in serve
    assert not re.search(r"trinity|areal|verl|trl|torchrl|\[test", serve), serve
    venv = tmp_path / "served"
    (venv / "bin").mkdir(parents=True)
    for stamp in (".expbuf-serve", ".expbuf-native"):  # what `make serve` leaves, newer than its sources
        (venv / stamp).touch()
    assert not any("pip" in line for line in make_dry_run("setup-serve", venv))
    rest = make_dry_run("setup", venv)
    installs = [line for line in rest if "pip install" in line]
    assert installs and '-e ".[test,trinity,ray,areal,verl,transferqueue,trl,torchrl,docs]"' in installs[0], rest
    assert not any('".[native]"' in line or '"torch==' in line for line in rest), rest  # serving's, done
    assert rest[-1] == f"touch {venv}/.expbuf-installed", rest


def test_make_serve_and_make_test_write_expbufs_bytecode_before_they_start_python(tmp_path: Path) -> None:
    """Where PYTHONDONTWRITEBYTECODE is set (containers, CI images), Python compiles each module of
    expbuf at every start unless its bytecode was written beforehand: a server's start costs nearly
    twice the CPU, and the suite starts hundreds."""
    venv = tmp_path / "ready"
    (venv / "bin").mkdir(parents=True)
    for stamp in (".expbuf-serve", ".expbuf-native", ".expbuf-installed"):
        (venv / stamp).touch()
    for target, first_python in (("serve", "expbuf serve"), ("test", "-m ruff")):
        lines = make_dry_run(target, venv)
        compiled = [at for at, line in enumerate(lines) if "-m compileall" in line and "client server proto" in line]
        started = [at for at, line in enumerate(lines) if first_python in line]
        assert compiled and started and compiled[0] < started[0], lines


# What `pip check` may list after `make setup` (docs/getting-started.md says why): the requirements of the
# frameworks installed with --no-deps, and the pins no one set of versions meets.
NO_DEPS = {"trinity-rft", "areal", "verl"}
CONFLICTS = {
    ("trinity-rft", "transformers"),
    ("areal", "transformers"),
    ("areal", "torch"),
    ("areal", "hydra-core"),
    ("areal", "omegaconf"),
    ("areal", "networkx"),
    ("areal", "peft"),
    ("verl", "tensordict"),
    ("virtualenv", "packaging"),
}


def test_pip_check_lists_only_the_unmet_requirements_the_docs_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120, check=False
    )
    unexpected = []
    for line in done.stdout.splitlines():
        missing = re.fullmatch(r"(\S+) \S+ requires (\S+), which is not installed\.", line)
        conflict = re.fullmatch(r"(\S+) \S+ has requirement ([\w.-]+).*, but you have \S+ \S+\.", line)
        if missing and missing.group(1) in NO_DEPS:
            continue
        if conflict and (conflict.group(1), conflict.group(2)) in CONFLICTS:
            continue
        if line != "No broken requirements found.":
            unexpected.append(line)
    assert not unexpected, unexpected
    setup = " ".join(page("getting-started.md").split())
    assert "`pip check` lists" in setup and all(f"`{package}`" in setup for _, package in CONFLICTS)


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    """The root .dockerignore (the build context is the repository root) as Docker reads it."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # a directory takes its contents along
        return any(
            fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, pattern.removeprefix("**/"))
            for pattern in patterns
            for prefix in prefixes
        )

    local_state = (
        ".venv/bin/python",
        ".git/HEAD",
        "expbuf-data/data.mdb",
        "server/__pycache__/app.cpython-311.pyc",
        ".pytest_cache/v",
        ".ruff_cache/x",
        ".hypothesis/x",
        "build/lib",
        "expbuf.egg-info/PKG-INFO",
        "client/trxp/codec/_native/parse.cpython-311-x86_64-linux-gnu.so",  # compiled for this machine, by make setup
    )
    sources = ("Makefile", "pyproject.toml", "README.md", "server/app.py", "proto/expbuf/v1/buffer.proto")
    sources += ("setup.py", "client/native_build.py", "client/native.py", "client/trxp/codec/parse.py")
    assert [p for p in local_state if not ignored(p)] == []
    assert [p for p in sources if ignored(p)] == []


def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """docker/Dockerfile's stages: each stage's FROM line and its instructions, continued lines joined."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    stages: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("FROM "):
            stages.append((line, []))
        elif line.strip() and not line.startswith("#") and stages:
            stages[-1][1].append(" ".join(line.split()))
    return stages


def test_image_builds_the_compiled_wheel_and_runs_it_without_a_compiler() -> None:
    """A build stage with a C compiler builds the wheel, failing rather than leaving the codec pure
    Python; the slim final stage, on the same base, installs that wheel and fails to build unless
    the installed expbuf runs the compiled modules."""
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert base is not None and base.group(1).startswith("python:3.11")
    (build_from, build), (final_from, final) = dockerfile_stages()
    assert build_from == "FROM ${PYTHON_IMAGE} AS wheel" and final_from == "FROM ${PYTHON_IMAGE}"
    assert any(re.search(r"^RUN apt-get .*install .*\bgcc\b", line) for line in build)
    assert any(
        re.search(r"^RUN EXPBUF_REQUIRE_NATIVE=1 pip wheel .*--no-deps --wheel-dir /wheels \.$", line) for line in build
    )
    assert not any(re.search(r"\b(gcc|make|build-essential)\b", line) for line in final)
    assert "COPY --from=wheel /wheels /wheels" in final
    install = next(line for line in final if "/wheels/expbuf-" in line)
    assert re.search(r"pip install .*/wheels/expbuf-\*\.whl", install)
    assert "compiled('expbuf.client.trxp.codec.parse')" in install  # the image build fails on a pure-Python install
    assert any(re.match(r"USER (?!root)", line) for line in final)
    assert any(re.match(r'HEALTHCHECK .*CMD \["expbuf", "health"\]', line) for line in final)
    assert any(line.startswith("VOLUME") for line in final)
    prometheus = (DOCKER / "prometheus.yml").read_text()
    assert "expbuf:9400" in prometheus


# ---- start-up, ports and the command line ----------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`expbuf ARGS` in a child process (tests/cli_forks.py); a server that starts when it should not
    times out here."""
    return cli_forks.run(*args, env=env, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """The command failed with exit code 2 and one line on stderr that contains every word."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def listener() -> socket.socket:
    """A socket listening on a free loopback port, as another program would hold it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_second_server_on_a_taken_port_refuses_to_start(tmp_path: Path) -> None:
    first = ServerProcess(str(tmp_path / "a"))
    try:
        done = cli("serve", "--data", str(tmp_path / "b"), "--port", str(first.port), "--metrics-port", "-1")
        one_line_error(done, f"127.0.0.1:{first.port}", "in use")  # "Address already in use"
        assert not (tmp_path / "b").exists()  # a refused start creates nothing
        with BufferClient(first.target) as c:  # the first server still owns its port
            assert "default" in c.stats()
    finally:
        assert first.stop(signal.SIGTERM) == 0


def test_start_up_failures_are_one_line(tmp_path: Path, listener: socket.socket) -> None:
    taken = listener.getsockname()[1]
    done = cli("serve", "--data", str(tmp_path / "m"), "--port", "0", "--metrics-port", str(taken))
    one_line_error(done, "metrics port", str(taken))
    assert not (tmp_path / "m").exists()
    missing = str(tmp_path / "no-such-cert.pem")
    tls = {"EXPBUF_SERVER_TLS_CERT": missing, "EXPBUF_SERVER_TLS_KEY": missing}
    done = cli("serve", "--data", str(tmp_path / "t"), "--port", "0", "--metrics-port", "-1", env=tls)
    one_line_error(done, missing)


def test_ctrl_c_stops_the_server_and_its_ingest_processes_without_a_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (`make serve`) sends SIGINT to the whole process group: the ingest
    processes take it too. The server stops cleanly, and nothing prints a traceback or an error."""
    proc = ServerProcess(str(tmp_path), "--ingest-processes", "2", own_group=True)
    with BufferClient(proc.target) as c:
        c.push(payload("grpo_group.trxp"))
    code = proc.stop(signal.SIGINT, group=True)
    log = "".join(proc.log)  # to its end: every process of the group writes to it
    assert code == 0, log
    assert "expbuf stopped" in log, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and " ERROR " not in log, log
    assert "ingest process died" not in log, log


def test_a_tables_block_the_data_directory_does_not_match_is_one_line(tmp_path: Path) -> None:
    """A [[tables]] block edited after the table was made (group_size 8, then 4) and a restart:
    one line naming the table and the setting, exit 2, and the table as it was."""
    config = tmp_path / "expbuf.toml"
    config.write_text('[[tables]]\nname = "grpo"\ngroup_size = 8\n')
    first = ServerProcess(str(tmp_path / "data"), "--config", str(config), warm=False)
    assert first.stop(signal.SIGTERM) == 0
    config.write_text('[[tables]]\nname = "grpo"\ngroup_size = 4\n')
    done = cli(
        "serve", "--data", str(tmp_path / "data"), "--port", "0", "--metrics-port", "-1", "--config", f"{config}"
    )
    one_line_error(done, "'grpo'", "group_size", "8", "4", "[[tables]]")
    config.write_text('[[tables]]\nname = "grpo"\ngroup_size = 8\n')
    again = ServerProcess(str(tmp_path / "data"), "--config", str(config), warm=False)
    try:
        with BufferClient(again.target) as c:
            assert next(t for t in c.list_tables() if t.name == "grpo").group_size == 8
    finally:
        assert again.stop(signal.SIGTERM) == 0


def test_a_table_named_twice_in_the_config_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "expbuf.toml"
    config.write_text('[[tables]]\nname = "grpo"\ngroup_size = 8\n\n[[tables]]\nname = "grpo"\ngroup_size = 8\n')
    done = cli("serve", "--data", f"{tmp_path}/data", "--port", "0", "--metrics-port", "-1", "--config", str(config))
    one_line_error(done, str(config), "'grpo'", "twice", "[[tables]]")
    assert not (tmp_path / "data").exists()  # refused before the data directory is opened


def test_a_locked_data_directory_is_one_line(tmp_path: Path) -> None:
    running = ServerProcess(str(tmp_path / "locked"))
    try:
        done = cli("serve", "--data", str(tmp_path / "locked"), "--port", "0", "--metrics-port", "-1")
        one_line_error(done, str(tmp_path / "locked"), "another expbuf process")
        one_line_error(cli("check", "--data", str(tmp_path / "locked")), "another expbuf process")
    finally:
        assert running.stop(signal.SIGTERM) == 0


def test_check_refuses_a_directory_without_data(tmp_path: Path, start_server: Servers) -> None:
    absent, empty = tmp_path / "no-such-dir", tmp_path / "empty"
    empty.mkdir()
    for directory in (absent, empty):
        one_line_error(cli("check", "--data", str(directory)), str(directory), "no expbuf data")
    assert not absent.exists() and list(empty.iterdir()) == []
    start_server(tmp_path / "real").stop(grace=1)
    done = cli("check", "--data", str(tmp_path / "real"))
    assert done.returncode == 0 and done.stdout.strip() == "default: ok", done.stderr


def test_server_process_uses_free_ports_and_fails_fast(tmp_path: Path) -> None:
    held = []
    for port in (9400, 50051):  # as `make serve` would hold them; taken already is as good
        sock = socket.socket()
        with contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        held.append(sock)
    try:
        proc = ServerProcess(str(tmp_path / "a"))
        try:
            assert proc.port not in (9400, 50051) and proc.metrics_port not in (0, 9400, 50051)
            assert ("expbuf_storage_bytes", ()) in scrape(proc.metrics_port)
        finally:
            assert proc.stop(signal.SIGTERM) == 0
        with pytest.raises(AssertionError, match=r"exit code 2\)[\s\S]*metrics_port"):
            ServerProcess(str(tmp_path / "b"), "--metrics-port", "70000")
    finally:
        for sock in held:
            sock.close()


def test_serve_help_describes_the_metrics_port() -> None:
    text = " ".join(cli("serve", "--help").stdout.split())
    assert "0 picks a free one, -1 = off" in text and "0 = off" not in text
    assert "--metrics-host" in text


def listening_here(port: int) -> list[str]:
    """The IPv4 addresses this process listens on at `port`, as the kernel lists its sockets: a
    scrape of another address can reach another process that happens to hold the same port."""
    own = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed (the listing's own, among others)
            own.add(os.readlink(f"/proc/self/fd/{fd}"))
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state, inode = (line.split()[i] for i in (1, 3, 9))
        address, at = local.split(":")
        if state == "0A" and int(at, 16) == port and f"socket:[{inode}]" in own:
            found.append(socket.inet_ntoa(int(address, 16).to_bytes(4, "little")))
    return found


def test_metrics_host_binds_the_metrics_endpoint_apart(start_server: Servers) -> None:
    server = start_server(metrics_host="127.0.0.2")
    text = urllib.request.urlopen(f"http://127.0.0.2:{server.metrics_port}/metrics", timeout=10).read()
    assert b"expbuf_storage_bytes" in text
    assert listening_here(server.metrics_port) == ["127.0.0.2"]


# ---- concurrent streams ----------------------------------------------------------------


def test_waiting_sample_streams_leave_room_for_other_calls(start_server: Servers) -> None:
    server = start_server(workers=8, max_sample_streams=4)  # below what the push scope's share leaves (5)
    limit = server.config.sample_stream_limit
    ended: list[grpc.RpcError] = []

    def wait_on(call: grpc.Call) -> None:
        with contextlib.suppress(StopIteration):
            try:
                next(call)
            except grpc.RpcError as exc:
                ended.append(exc)

    with BufferClient(f"127.0.0.1:{server.port}") as c:
        c.create_table("other")  # pushed to below, while the streams wait on the empty default table
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        request = pb.SampleRequest(table="default", num_groups=1, wait_seconds=60)
        calls = [stub.Sample(iter([request]), timeout=60) for _ in range(limit + 1)]
        for call in calls:
            threading.Thread(target=wait_on, args=(call,), daemon=True).start()
        wait_until(lambda: len(ended) >= 1, timeout=30)
        (refused,) = ended
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_sample_streams = {limit}" in refused.details()
        assert "EXPBUF_MAX_SAMPLE_STREAMS" in refused.details()
        pushed = stub.Push(pb.PushRequest(table="other", payload=payload("grpo_group.trxp")), timeout=10)
        assert len(pushed.stored_uids) == 8
        assert [t.name for t in stub.Stats(pb.StatsRequest(), timeout=10).tables]
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert len(ended) == 1  # the others still wait for data
        for call in calls:
            call.cancel()


# ---- a new user's first steps -----------------------------------------------------------


def test_rollout_worker_runs_again(start_server: Servers) -> None:
    """A new user's rollout worker run twice before any trainer: the second run finds every
    prompt of the dataset generated, pushes nothing and ends cleanly, instead of failing on the
    dataset that exists or pushing its prompts again."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    worker = [sys.executable, str(ROOT / "examples" / "rollout_worker.py"), "--target", target]
    worker += ["--size", "2", "--wait", "1"]
    first = subprocess.run(worker, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("stored 8, duplicates 0") == 2, first.stdout
    again = subprocess.run(worker, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert "stored" not in again.stdout and "no prompt to claim within 1s" in again.stdout, again.stdout
    with BufferClient(target) as c:
        assert c.stats()["default"].pushed == 2 * 8
        assert [row.generated for row in c.ledger("default", "prompts").counts] == [2]


def test_readme_and_docs_say_how_to_run_the_installed_commands() -> None:
    for name in ("README", "getting-started.md"):
        text = page(name)
        assert "source .venv/bin/activate" in text and ".venv/bin/expbuf" in text, name
        assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text, name
    assert "--index-url https://download.pytorch.org/whl/cpu" in page("getting-started.md")
    serving = page("operations/serving.md")
    assert "metrics_host" in serving and "--metrics-host" in serving


def test_health_command_does_not_load_torch() -> None:
    """The container runs `expbuf health` every few seconds: it must not import the server's torch."""
    code = "import sys, expbuf.server.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_get_reports_missing_uids(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    stored = [i.uid for i in trxp.parse(payload("grpo_group.trxp"))][:2]
    with BufferClient(target) as c:
        c.push(payload("grpo_group.trxp"))
        found = c.get([stored[0], "no/such/uid", stored[1]])
    assert [e.eid.uid for e in found] == stored and found.missing_uids == ["no/such/uid"]

    async def get_async() -> GetResult:
        async with AsyncBufferClient(target) as ac:
            return await ac.get(["gone", stored[1]])

    found = asyncio.run(get_async())
    assert [e.eid.uid for e in found] == stored[1:] and found.missing_uids == ["gone"]


def test_proto_names_its_go_package() -> None:
    assert pb.DESCRIPTOR.GetOptions().go_package.endswith(";expbufv1")


def test_health_and_pushes_are_answered_when_every_other_worker_is_busy(start_server: Servers) -> None:
    # No workers kept per scope: the reserve alone keeps the last worker from the Sample streams.
    server = start_server(workers=4, max_sample_streams=3, push_scope_workers=0, sample_scope_workers=0)
    assert server.config.reserved_worker_count == 1

    def wait_on(call: grpc.Call) -> None:
        with contextlib.suppress(grpc.RpcError, StopIteration):
            next(call)

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        request = pb.SampleRequest(table="default", num_groups=1, wait_seconds=60)
        streams = [stub.Sample(iter([request]), timeout=60) for _ in range(3)]
        for call in streams:
            threading.Thread(target=wait_on, args=(call,), daemon=True).start()
        refused: list[grpc.RpcError] = []

        def push_stream_refused() -> bool:  # once the three streams hold the three workers outside the reserve
            try:
                next(stub.PushStream(iter([]), timeout=60))
            except StopIteration:  # accepted, and ended as it sent nothing
                return False
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.append(exc)
                    return True
            return False

        time.sleep(1.0)  # the streams reach the server first: a probe taken meanwhile could refuse one
        wait_until(push_stream_refused, timeout=30)
        assert not any(call.done() for call in streams), "a waiting Sample stream was refused"
        assert "reserved_workers = 1" in refused[0].details() and "EXPBUF_WORKERS" in refused[0].details()
        pushed = stub.Push(pb.PushRequest(table="default", payload=payload("grpo_group.trxp")), timeout=10)
        assert len(pushed.stored_uids) == 8
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        for call in streams:
            call.cancel()


def test_packages_declare_their_type_hints() -> None:
    """PEP 561: `py.typed` in the client and server packages, and shipped in the wheel."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    for package in ("expbuf.client", "expbuf.server"):
        assert "py.typed" in package_data[package]
        assert importlib.resources.files(package).joinpath("py.typed").is_file()


def test_stats_columns_fit_long_table_names() -> None:
    """Every column starts where its header starts, whatever the longest table name."""
    counts = dict.fromkeys(("pending", "computing", "ready", "leased", "consumed", "groups_failed"), 3)
    counts |= {f"groups_{s}": 1 for s in ("pending", "computing", "ready", "leased", "dropped")}
    row = counts | {"bytes": 2048, "oldest_age_seconds": 5.0, "min_model_version": 1, "max_model_version": 12}
    zero = dict.fromkeys((f.name for f in dataclasses.fields(TableStats)), 0) | {"last_failure": ""}
    names = ("t", "a_table_name_of_forty_characters_xxxxxx")
    tables = {name: TableStats(**zero | row | {"name": name}) for name in names}
    info = ServerInfo("x", "1", "cpu", 1 << 20, uptime_seconds=1.0, storage_bytes=1, lmdb_map_used_ratio=0.1)
    text = render(info, tables, {"t": (1.5, 2.5)}).splitlines()
    assert text[1] == "scrub off, found 0 damaged since the start; no complete pass yet"
    lines = text[3:]
    cell = r"\S+(?: \S+)*"  # cells ("2.0 KB") may hold one space, columns are two apart
    starts = [m.start() for m in re.finditer(cell, lines[0])]
    assert len(starts) == len(COLUMNS)
    for line in lines[1:]:
        assert [m.start() for m in re.finditer(cell, line)] == starts, line


def test_stats_watch_shows_no_rate_of_a_table_made_again_under_its_name() -> None:
    """A table dropped and made again between two views had its counters go back: `--watch`
    showed -13.0 pushes a second (a helper's audit). Its rate is left out (shown as "-") for
    that view, and counted again from the next."""
    zero = dict.fromkeys((f.name for f in dataclasses.fields(TableStats)), 0) | {"last_failure": ""}
    before = {
        "r": TableStats(**zero | {"name": "r", "pushed": 30, "sampled": 20}),
        "s": TableStats(**zero | {"name": "s"}),
    }
    now = {
        "r": TableStats(**zero | {"name": "r", "pushed": 4, "sampled": 0}),
        "s": TableStats(**zero | {"name": "s", "pushed": 10, "sampled": 4}),
    }
    assert rates_between(before, now, 2.0) == {"s": (5.0, 2.0)}
    assert rates_between(now, now, 2.0) == {"r": (0.0, 0.0), "s": (0.0, 0.0)}


def test_upkeeps_log_lines_name_the_tables() -> None:
    """The upkeep log line "leases expired: 2 (2 experiences requeued)" named no table: an operator asks whose."""
    tables = {"beta": {"leases_expired": 1, "requeued": 4}, "alpha": {"leases_expired": 2, "requeued": 8}}
    assert _by_table(tables, "leases_expired", "requeued") == "tables alpha 2 (8), beta 1 (4)"
    assert _by_table({"gamma": {"groups_timed_out": 3}}, "groups_timed_out") == "table gamma 3"
    assert _by_table({}, "rollouts_returned") == "of tables dropped since"


def test_stats_says_why_advantages_cannot_be_computed() -> None:
    """`expbuf stats` names the advantage worker's failure where it shows the device, and says so
    where nothing has needed it yet (torch not loaded) rather than a device not known yet."""
    info = ServerInfo("x", "1", "", 1 << 20, uptime_seconds=1.0, storage_bytes=1, lmdb_map_used_ratio=0.1)
    assert "advantages on a device not known yet" in render(info, {}, {}).splitlines()[0]
    idle = dataclasses.replace(info, advantage_worker_state="not_needed")
    assert render(idle, {}, {}).splitlines()[0].endswith("advantages not needed yet (torch not loaded)")
    failed = dataclasses.replace(info, advantage_worker_failure="the advantage worker did not start: ImportError: x")
    head = render(failed, {}, {}).splitlines()[0]
    assert head.endswith("advantages cannot be computed (the advantage worker did not start: ImportError: x)"), head


def test_cli_version_and_help_on_every_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "expbuf.server.cli", "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == f"expbuf {importlib.metadata.version('expbuf')}"
    pending = [("expbuf", build_parser())]
    while pending:  # every command and sub-command, and every option of each
        name, command = pending.pop()
        for action in command._actions:
            assert action.help, f"{name} {'/'.join(action.option_strings) or action.dest} has no help text"
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{name} {sub}", parser) for sub, parser in action.choices.items()]


def test_start_up_line_summarises_the_tables() -> None:
    """One short line however many tables a server holds (the names of 10,000 would fill a screen)."""
    assert _summary(["default", "grpo8"]) == "2 (default, grpo8)"
    line = _summary([f"table{i}" for i in range(10_000)])
    assert line == "10000 (table0, table1, table2, table3, table4, and 9995 more)"


def test_table_commands(child_server: ServerProcess) -> None:
    """create, list, describe and drop a table from the shell, settings in TOML's names and values
    (on the module's shared server, which must stop cleanly after its tests)."""
    target = ("--target", child_server.target)
    settings = ("group_size=8", "estimator=rloo", "drop_zero_variance=true", "shaping={reward_clip=5.0}")
    done = cli("table", "create", "grpo4", *settings, *target)
    assert done.returncode == 0, done.stderr
    with BufferClient(child_server.target) as c:
        (made,) = (t for t in c.list_tables() if t.name == "grpo4")
        c.push(payload("grpo_group.trxp"), table="grpo4")
    assert (made.group_size, made.estimator, made.drop_zero_variance) == (8, "rloo", True)
    assert made.shaping.reward_clip == 5.0
    again = cli("table", "create", "grpo4", "group_size=4", *target)
    assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr
    # --exist-ok (and the other options) before, between or after the settings
    for order in (
        ("grpo4", "--exist-ok", *settings),
        ("grpo4", settings[0], "--exist-ok", *target, *settings[1:]),
        ("--exist-ok", "grpo4", *settings),
    ):
        same = cli("table", "create", *order, *target)
        assert same.returncode == 0 and not same.stderr, (order, same.stderr)
    differs = cli("table", "create", "grpo4", "--exist-ok", "group_size=4", *settings[1:], *target)
    assert differs.returncode == 1 and "group_size: the table has 8, the request 4" in differs.stderr
    misplaced = cli("table", "create", "grpo4", *settings, "--no-such-option", *target)
    assert misplaced.returncode == 2 and "unrecognized arguments: --no-such-option" in misplaced.stderr
    refused = cli("table", "create", "x", "estimator=nope", *target)  # the server's refusal, with its reason
    assert refused.returncode == 1 and "INVALID_ARGUMENT (invalid_config): table 'x'" in refused.stderr
    bad = cli("table", "create", "x", "group_size", *target)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
    # Mistakes the client catches before it calls: one line naming the setting, exit code 2.
    one_line_error(cli("table", "create", "x", "group_size=-1", *target), "group_size", "-1")
    one_line_error(cli("table", "create", "x", "gruop_size=4", *target), "unknown table setting", "gruop_size")
    one_line_error(cli("table", "create", "x", "estimator_params=5", *target), "estimator_params", "5")
    # The command's own arguments as settings: named, with the argument or option to use.
    one_line_error(cli("table", "create", "x", "name=y", *target), "name=y", "NAME")
    one_line_error(cli("table", "create", "x", "exist_ok=true", *target), "exist_ok=true", "--exist-ok")
    one_line_error(cli("table", "create", "x", "preset=queue", *target), "preset=queue", "--preset")
    # A setting given twice: named, not the last one taken silently.
    one_line_error(cli("table", "create", "x", "group_size=4", "group_size=8", *target), "group_size", "twice")
    listing = cli("table", "list", *target).stdout.splitlines()
    assert listing[0].split() == [
        "table",
        "group_by",
        "group_size",
        "estimator",
        "ready",
        "leased",
        "pending",
        "computing",
    ]
    assert any(line.split()[:4] == ["grpo4", "task", "8", "rloo"] for line in listing[1:])
    described = cli("table", "describe", "grpo4", *target).stdout
    toml_part = tomllib.loads(described.split("\n\n# stats")[0])["tables"][0]
    assert made.settings() == toml_part  # pastes into a config as it is
    assert re.search(r"^# pushed = \d+$", described, re.M)
    refused = cli("table", "drop", "grpo4", *target)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    dropped = cli("table", "drop", "grpo4", "--yes", *target)
    assert dropped.returncode == 0 and dropped.stdout.startswith("dropped grpo4: ")
    missing = cli("table", "describe", "grpo4", *target)
    assert missing.returncode == 1 and "no table 'grpo4'" in missing.stderr
    with BufferClient(child_server.target) as c:
        assert "x" not in {t.name for t in c.list_tables()}  # nothing refused was made


def test_limits_on_waiting_calls_come_from_defaults_file_environment_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ServerConfig()
    assert (config.push_stream_limit, config.waiting_admit_limit, config.reserved_worker_count) == (32, 16, 8)
    assert (config.push_stream_idle_seconds, config.max_wait_seconds) == (120.0, 600.0)
    with pytest.raises(ConfigError, match=r"reserved_workers must be an integer from 1 to workers - 1 = 7"):
        ServerConfig(workers=8, reserved_workers=8)
    with pytest.raises(ConfigError, match=r"push_stream_idle_seconds must be a number of seconds above 0"):
        ServerConfig(push_stream_idle_seconds=0)
    assert config.push_stream_window == 8
    with pytest.raises(ConfigError, match=r"push_stream_window must be an integer from 1 to 1024, got 0"):
        ServerConfig(push_stream_window=0)
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text("max_push_streams = 3\nmax_wait_seconds = 30\nreserved_workers = 2\n")
    monkeypatch.setenv("EXPBUF_MAX_WAITING_ADMITS", "5")
    monkeypatch.setenv("EXPBUF_PUSH_STREAM_IDLE_SECONDS", "7.5")
    monkeypatch.setenv("EXPBUF_PUSH_STREAM_WINDOW", "3")
    loaded = load(str(config_file), {"max_wait_seconds": 9.0})
    assert loaded.push_stream_window == 3
    assert (loaded.push_stream_limit, loaded.waiting_admit_limit, loaded.reserved_worker_count) == (3, 5, 2)
    assert (loaded.push_stream_idle_seconds, loaded.max_wait_seconds) == (7.5, 9.0)
    monkeypatch.setenv("EXPBUF_PUSH_STREAM_IDLE_SECONDS", "-1")
    done = cli("serve", "--data", str(tmp_path / "data"))  # a child: the command routes the root logger
    one_line_error(done, "push_stream_idle_seconds")  # refused before anything starts
    assert not (tmp_path / "data").exists()


def test_workers_kept_per_scope_come_from_defaults_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quarter of the workers for each scope by default, fewer when reserved_workers leaves fewer:
    settings that started a server before still do."""
    assert ServerConfig().scope_shares == {"push": 16, "sample": 16}
    assert ServerConfig(workers=16, reserved_workers=12).scope_shares == {"push": 2, "sample": 2}
    assert ServerConfig(workers=2).scope_shares == {"push": 0, "sample": 0}
    kept = ServerConfig(workers=64, max_sample_streams=63, max_table_streams=48, reserved_workers=20).scope_shares
    assert kept == {"push": 16, "sample": 16}
    with pytest.raises(ConfigError, match=r"push_scope_workers must be an integer from 0 to workers - 1 = 7"):
        ServerConfig(workers=8, push_scope_workers=-1)
    with pytest.raises(ConfigError, match=r"sample_scope_workers must be an integer from 0 to workers - 1 = 7"):
        ServerConfig(workers=8, sample_scope_workers=8)
    message = r"push_scope_workers \+ sample_scope_workers = 9 must be at most workers - reserved_workers = 7"
    with pytest.raises(ConfigError, match=message):
        ServerConfig(workers=8, push_scope_workers=6, sample_scope_workers=3)
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text("workers = 32\npush_scope_workers = 10\n")
    monkeypatch.setenv("EXPBUF_SAMPLE_SCOPE_WORKERS", "0")
    assert load(str(config_file)).scope_shares == {"push": 10, "sample": 0}


def admitted(limits: CallLimits, method: str, request: object) -> tuple[int, str]:
    """How many more `method` calls `limits` lets in at once (each kept in progress), and the refusal
    of the next."""
    count = 0
    while not isinstance(taken := limits.acquire(method, request), str):
        count += 1
    return count, taken


def test_default_shares_on_64_workers() -> None:
    """The figures the README gives for the default settings (64 workers, 8 reserved, 16 kept for
    each scope): what one scope's calls may hold at their worst, and what the other then has."""
    limits = call_limits(ServerConfig())
    sampled, refusal = admitted(limits, "Sample", pb.SampleRequest())  # below max_sample_streams = 48
    assert sampled == 40 and "push_scope_workers = 16" in refusal and "reserved_workers = 8" in refusal
    assert admitted(limits, "PushStream", pb.PushRequest())[0] == 16
    assert admitted(limits, "Push", pb.PushRequest())[0] == 8

    limits = call_limits(ServerConfig())
    pushed, refusal = admitted(limits, "Push", pb.PushRequest())  # blocked on a full table, say
    assert pushed == 48 and "sample_scope_workers = 16" in refusal
    assert admitted(limits, "Sample", pb.SampleRequest())[0] == 8  # sample_scope_workers - reserved_workers
    assert admitted(limits, "Get", pb.GetRequest())[0] == 8
    assert admitted(limits, "Ack", pb.AckRequest())[0] == 2
    created, refusal = admitted(limits, "CreateTable", pb.CreateTableRequest())
    assert created == 2 and "all workers = 64" in refusal

    limits = call_limits(ServerConfig())
    assert admitted(limits, "PushStream", pb.PushRequest())[0] == 32  # max_push_streams
    assert admitted(limits, "Admit", pb.AdmitRequest(wait_seconds=5))[0] == 8
    assert admitted(limits, "Sample", pb.SampleRequest())[0] == 16  # the trainers' whole share
    assert admitted(limits, "Push", pb.PushRequest())[0] == 8  # the reserve


def test_check_at_open_and_the_scrub_are_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """quick (the default) or full, and the scrub's rate and interval, from the environment as
    from the file and flags; nothing else."""
    config = load()
    assert (config.check_at_open, config.scrub_mb_per_second, config.scrub_interval_seconds) == ("quick", 32, 86400)
    monkeypatch.setenv("EXPBUF_CHECK_AT_OPEN", "full")
    monkeypatch.setenv("EXPBUF_SCRUB_MB_PER_SECOND", "0")
    monkeypatch.setenv("EXPBUF_SCRUB_INTERVAL_SECONDS", "3600")
    config = load()
    assert (config.check_at_open, config.scrub_mb_per_second, config.scrub_interval_seconds) == ("full", 0, 3600)
    toml = tmp_path / "expbuf.toml"
    toml.write_text("scrub_mb_per_second = 8\nscrub_interval_seconds = 600\n")
    monkeypatch.delenv("EXPBUF_SCRUB_MB_PER_SECOND")
    monkeypatch.delenv("EXPBUF_SCRUB_INTERVAL_SECONDS")
    assert (load(str(toml)).scrub_mb_per_second, load(str(toml)).scrub_interval_seconds) == (8, 600)
    assert load(str(toml), {"scrub_mb_per_second": 2.5}).scrub_mb_per_second == 2.5  # a flag wins
    monkeypatch.setenv("EXPBUF_CHECK_AT_OPEN", "some")
    with pytest.raises(ConfigError, match="check_at_open must be 'full' or 'quick'"):
        load()
    monkeypatch.delenv("EXPBUF_CHECK_AT_OPEN")
    for name, value, bound in (
        ("scrub_mb_per_second", -1, "from 0 (no scrub) to 100000"),
        ("scrub_interval_seconds", 10, "from 60 to 31536000 (a year)"),
    ):
        with pytest.raises(ConfigError, match=f"{name} must be a number .*{re.escape(bound)}, got {value}"):
            load(None, {name: value})


def test_log_configuration_keeps_the_host_process_handlers() -> None:
    """`configure` installs one stderr handler, replaced by a second call; an embedding
    process's own handlers (pytest's capture, say) stay and keep receiving expbuf's lines."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    host = logging.handlers.BufferingHandler(100)
    root.addHandler(host)
    try:
        logs.configure("json")
        logs.configure("text")
        ours = [h for h in root.handlers if h not in saved_handlers and h is not host]
        assert len(ours) == 1 and not isinstance(ours[0].formatter, logs.JsonFormatter)
        logging.getLogger("expbuf.server.test").warning("routed")
        assert host in root.handlers and [r.getMessage() for r in host.buffer] == ["routed"]
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def test_log_lines_go_to_the_stderr_of_the_moment() -> None:
    """The handler writes to sys.stderr as it is when a line comes, not as it was when configured:
    a process that swaps it (a test runner's capture, closed after its test) never finds expbuf's
    threads writing to a closed stream ("--- Logging error ---")."""
    root = logging.getLogger()
    saved_handlers, saved_level, saved_stderr = list(root.handlers), root.level, sys.stderr
    first, second = io.StringIO(), io.StringIO()
    try:
        sys.stderr = first
        logs.configure("text")
        first.close()  # the stream of the moment of the configure is gone
        sys.stderr = second
        logging.getLogger("expbuf.server.test").warning("after the swap")
        written = second.getvalue()
        assert "Logging error" not in written and written.endswith("after the swap\n"), written
    finally:
        sys.stderr = saved_stderr
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def test_an_ipv6_host_serves_grpc_and_metrics(start_server: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """host = "::1" binds gRPC and /metrics on the IPv6 loopback (gRPC takes it in brackets), and
    the start-up line names the addresses as a client would write them."""
    with caplog.at_level(logging.INFO, logger="expbuf"):
        server = start_server(host="::1")
    with BufferClient(f"[::1]:{server.port}", timeout=10) as client:
        assert client.push(payload("grpo_group.trxp")).stored
    text = urllib.request.urlopen(f"http://[::1]:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert "expbuf_tables" in text
    assert any(f"listening on [::1]:{server.port} (metrics [::1]:{server.metrics_port}" in m for m in caplog.messages)


def test_a_sample_stream_that_never_sends_its_request_is_ended_naming_the_bound(start_server: Servers) -> None:
    """A Sample stream opened and silent (a raw client waiting for the server to speak first, a
    writer that hung) holds a worker and one of max_sample_streams: it is ended DEADLINE_EXCEEDED
    after max_wait_seconds, naming it, as a silent PushStream is, not kept until its client's
    deadline (or for ever, without one); its slot then serves a trainer."""
    server = start_server(max_wait_seconds=1, max_sample_streams=1)
    silent: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        call = stub.Sample(iter(silent.get, None), timeout=60)
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
        reading = "expbuf-sample-first"  # the server's read of the first message, which ends with its call
        wait_for(lambda: reading not in {t.name for t in threading.enumerate()}, "the first message's read to end")
        silent.put(None)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "sent no SampleRequest" in ended.value.details()
        assert "max_wait_seconds = 1" in ended.value.details()
        request = pb.SampleRequest(table="default", num_groups=1, wait_seconds=0.1, allow_partial=True)
        assert list(stub.Sample(iter([request]), timeout=30)) == []  # the slot is free again


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("stats", "--target", "localhost"), "argument --target: target 'localhost' has no port"),
        (("table", "list", "--target", "localhost"), "argument --target: target 'localhost' has no port"),
        (("dataset", "list", "t", "--target", "localhost"), "argument --target: target 'localhost' has no port"),
        (("health", "--target", "localhost"), "argument --target: target 'localhost' has no port"),
        (("stats", "--watch", "-1"), "argument --watch: '-1' is not a number of seconds above 0"),
        (("stats", "--watch", "nan"), "argument --watch: 'nan' is not a number of seconds above 0"),
        (("health", "--timeout", "nan"), "argument --timeout: 'nan' is not a number of seconds above 0"),
        (("health", "--timeout", "1e10"), "argument --timeout: '1e10' is not a number of seconds above 0 and at most"),
        (("stats", "--watch", "1e308"), "argument --watch: '1e308' is not a number of seconds above 0 and at most"),
        (("stats", "--token", "op\ns"), "argument --token: token holds a space, a control or a non-ASCII character"),
        (("stats", "--tls-key", __file__), "expbuf stats: mutual TLS needs both --tls-cert and --tls-key"),
        (("stats", "--tls-ca", __file__), f"expbuf stats: Tls root_certificates ({__file__}) holds no PEM certificate"),
    ],
)
def test_a_client_commands_wrong_argument_is_named_without_a_traceback(args: tuple[str, ...], said: str) -> None:
    """A --target without a port ended `stats`, `table`, `dataset` and `export` in a ValueError's
    traceback (`health` went to port 443), and `stats --watch -1` or `health --timeout nan` in one of
    time.sleep's or a DEADLINE_EXCEEDED (a helper's audit): each is argparse's line, exit code 2."""
    done = cli_forks.run(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr and said in done.stderr, done.stderr
