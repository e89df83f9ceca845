"""Pushes validated and packed in worker processes: the same entries and refusals as in
the server's own process, a lone push decoded here, and a worker that dies is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import EID, BufferClient, BufferError, Experience, trxp
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ConfigError, ServerConfig, load
from expbuf.server.rpc.push import ingest as ingest_module
from expbuf.server.rpc.push import ingest_worker
from expbuf.server.rpc.push.ingest import Ingest, entries_of
from expbuf.server.store import Entry
from expbuf.server.store.schema.errors import InvalidPayload

from conftest import BAD_DIR, MANIFEST, Servers, payload


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server(ingest_processes=1)


@pytest.fixture(scope="module")
def ingest() -> Iterator[Ingest]:
    pool = Ingest(1)
    pool.start()
    yield pool
    pool.close()


def test_pushes_through_a_server_with_workers_store_and_refuse_alike(server: ExpbufServer) -> None:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_by="none", estimator="none")
        want = [item["uid"] for item in MANIFEST["payloads"]["mixed_batch.trxp"]["items"]]
        assert client.push(payload("mixed_batch.trxp"), table="t").stored == want
        assert client.push(payload("mixed_batch.trxp"), table="t").duplicates == want
        with pytest.raises(BufferError) as info:
            client.push((BAD_DIR / "prompt_longer_than_tokens.bin").read_bytes(), table="t")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_length" in info.value.details
        assert client.stats("t")["t"].pushed == len(want)


def test_a_worker_gives_the_entries_and_refusals_of_this_process(ingest: Ingest) -> None:
    worker = ingest._workers[0]
    assert worker.same  # it makes entries as the server does
    for name in sorted(MANIFEST["payloads"]):
        data = payload(name)
        assert worker.entries(data) == entries_of(data), name  # decoded there, not here
        assert ingest._in_worker(data) == entries_of(data), name
    for bad in sorted(BAD_DIR.glob("*.bin")):
        with pytest.raises(Exception) as here:
            entries_of(bad.read_bytes())
        with pytest.raises(type(here.value)) as there:
            ingest._in_worker(bad.read_bytes())
        assert str(there.value) == str(here.value), bad.name


def test_a_worker_whose_entries_are_laid_out_otherwise_decodes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server puts an entry together from a worker's fields by their place. A worker started
    from other code (expbuf upgraded under a running server) says which fields it makes, in its
    order, when it is ready: where they differ, the server decodes every push itself, and says so."""
    fields = ingest_worker.FIELDS
    monkeypatch.setattr(ingest_worker, "FIELDS", (fields[1], fields[0], *fields[2:]))  # the server's, here
    pool = Ingest(1)
    pool.start()
    try:
        assert "its code is not the server's" in caplog.text
        worker = pool._workers[0]
        assert not worker.same
        data = payload("mixed_batch.trxp")
        assert worker.entries(data) is None  # nothing handed to it
        monkeypatch.setattr(ingest_worker, "FIELDS", fields)
        assert pool._in_worker(data) == entries_of(data)  # decoded here, whole and right
        assert pool._workers[0] is worker and worker.process.poll() is None  # kept: a new one would be the same
    finally:
        pool.close()


def test_payloads_larger_than_the_shared_region_grow_it(ingest: Ingest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push of many MB passes whole, twice: the server grows the region for the payload,
    the worker for the packed experiences (a little larger); the memory past what a region
    keeps between pushes is given back after each."""
    keep = 4 << 20
    monkeypatch.setattr(ingest_worker, "_KEEP", keep)
    big = trxp.encode(
        Experience(
            eid=EID(batch=9, task=0, run=run),
            tokens=torch.arange(300_000, dtype=torch.int32),
            prompt_length=1,
            logprobs=torch.zeros(299_999),
            reward=float(run),
        )
        for run in range(8)
    )
    want = entries_of(big)
    assert len(big) > 16 << 20 and sum(len(entry.blob) for entry in want) > len(big)
    for _ in range(2):
        assert ingest._in_worker(big) == want
    region = ingest._workers[0].region
    assert region.size > len(big)  # grown by the worker, for the packed experiences
    assert os.fstat(region.fd).st_blocks * 512 <= keep  # the memory in use
    small = payload("grpo_group.trxp")
    assert ingest._in_worker(small) == entries_of(small)


def test_a_lone_push_is_decoded_here(ingest: Ingest, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no other push being decoded, a hand-off to a worker would only add its cost."""

    def no_hand_off(payload: bytes) -> None:
        raise AssertionError("a lone push was handed to a worker")

    monkeypatch.setattr(ingest, "_in_worker", no_hand_off)
    data = payload("grpo_group.trxp")
    assert ingest.entries(data) == entries_of(data)


def test_a_small_push_is_decoded_here_beside_others(ingest: Ingest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload below SMALL decodes faster than a hand-off takes (bench/RESULTS.md)."""

    def no_hand_off(payload: bytes) -> None:
        raise AssertionError("a small push was handed to a worker")

    monkeypatch.setattr(ingest, "_in_worker", no_hand_off)
    monkeypatch.setattr(ingest, "_decoding", 1)  # another push is being decoded
    data = payload("grpo_group.trxp")
    assert len(data) < ingest_module.SMALL
    assert ingest.entries(data) == entries_of(data)


def test_an_idle_worker_that_dies_is_reaped_and_replaced_at_once(ingest: Ingest) -> None:
    worker = ingest._workers[0]
    os.kill(worker.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while ingest._workers[0] is worker and time.monotonic() < deadline:  # no push reaches the pool meanwhile
        time.sleep(0.05)
    replacement = ingest._workers[0]
    assert replacement is not worker and replacement.process.poll() is None
    assert worker.process.returncode == -signal.SIGKILL  # reaped: no zombie is left
    assert not Path(f"/proc/{worker.process.pid}").exists() or "Z" not in _state(worker.process.pid)
    data = payload("grpo_group.trxp")
    assert ingest._in_worker(data) == entries_of(data)
    assert ingest._workers[0] is replacement  # the push found it ready


def test_a_stuck_worker_is_killed_and_replaced_and_no_push_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that is stopped rather than dead (SIGSTOP: a cgroup's freezer, a debugger, swapped
    out) held its push for good, every push after it waited for a worker to come free, and a stop
    of the server never ended (a helper's audit). Its push is decoded here once ANSWER_SECONDS (and
    one a MiB) pass, the worker killed and replaced; a push finding no worker free within
    WORKER_WAIT_SECONDS is decoded here; a pool closed with a worker stuck kills it, its push
    ending at once."""
    monkeypatch.setattr(ingest_module, "ANSWER_SECONDS", 0.5)
    monkeypatch.setattr(ingest_module, "WORKER_WAIT_SECONDS", 0.2)
    data = payload("grpo_group.trxp")
    pool = Ingest(1)
    pool.start()
    try:
        stuck = pool._workers[0]
        os.kill(stuck.process.pid, signal.SIGSTOP)
        got: list[object] = []
        first = threading.Thread(target=lambda: got.append(pool._in_worker(data)))
        first.start()
        time.sleep(0.1)  # the stuck worker took it
        assert pool._in_worker(data) == entries_of(data)  # none free: decoded here, not held
        first.join(30)
        assert got == [entries_of(data)] and stuck.process.returncode == -signal.SIGKILL
        replacement = pool._workers[0]
        assert replacement is not stuck and pool._in_worker(data) == entries_of(data)
        os.kill(replacement.process.pid, signal.SIGSTOP)
        monkeypatch.setattr(ingest_module, "ANSWER_SECONDS", 60.0)
        last = threading.Thread(target=lambda: got.append(pool._in_worker(data)))
        last.start()
        time.sleep(0.1)
        pool.close()  # the server's stop, its grace past
        last.join(10)
        assert not last.is_alive() and got[-1] == entries_of(data)
    finally:
        pool.close()


def test_a_worker_that_dies_while_none_can_start_leaves_pushes_decoded_here_until_one_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle worker that dies while its replacement cannot start (no file descriptors, say) keeps
    its place in the pool, closed: a push that takes it decodes here, and one RETRY_SECONDS later
    starts a worker again. Its place was lost: pushes then waited for an idle worker for good."""
    pool = Ingest(1)
    pool.start()
    try:
        worker, made = pool._workers[0], ingest_module._Worker

        def cannot_start(max_metadata_bytes: int) -> ingest_module._Worker:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(ingest_module, "_Worker", cannot_start)
        monkeypatch.setattr(ingest_module, "RETRY_SECONDS", 1.0)
        os.kill(worker.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        # the watch found it dead, could not replace it, and put it back in its place
        while not (worker.closed and pool._idle == [worker]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.closed and pool._idle == [worker]
        data = payload("grpo_group.trxp")
        with ThreadPoolExecutor(2) as threads:  # two pushes at once: each takes the place in turn
            decoded = [call.result(30) for call in [threads.submit(pool._in_worker, data) for _ in range(2)]]
        assert decoded == [entries_of(data)] * 2 and pool._idle == [worker]
        monkeypatch.setattr(ingest_module, "_Worker", made)
        time.sleep(1.0)
        assert pool._in_worker(data) == entries_of(data)
        replacement = pool._workers[0]
        assert replacement is not worker and not replacement.closed and replacement.process.poll() is None
    finally:
        pool.close()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_a_worker_that_dies_is_replaced(server: ExpbufServer) -> None:
    ingest = server.service.ingest
    ingest.start()
    dead = [worker.process.pid for worker in ingest._workers]
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
    data = payload("grpo_group.trxp")
    assert ingest._in_worker(data) == entries_of(data)
    assert [worker.process.pid for worker in ingest._workers] != dead
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_by="none", estimator="none")
        assert client.push(payload("grpo_group.trxp"), table="t").stored
        assert client.push(payload("multi_turn.trxp"), table="t").stored
    assert ingest._in_worker(data) == entries_of(data)


def test_the_workers_start_at_the_first_push_one_would_take_and_no_push_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool starts no process until a push overlaps another's decode with a payload a worker
    would take; that push is decoded here while they start in the background, and the pushes after
    they are ready go to them. A lone push, or one below SMALL, starts nothing."""
    monkeypatch.setattr(ingest_module, "SMALL", 0)  # the fixtures are small: hand them off all the same
    pool = Ingest(1)
    try:
        data = payload("grpo_group.trxp")
        assert pool.entries(data) == entries_of(data) and not pool._asked  # alone: decoded here
        with pool._free:
            pool._decoding += 1  # another push is being decoded
        handed: list[bytes | memoryview] = []
        monkeypatch.setattr(pool, "_in_worker", lambda payload: handed.append(payload) or entries_of(payload))
        assert pool.entries(data) == entries_of(data) and not handed  # decoded here, while they start
        deadline = time.monotonic() + 60
        while not pool._workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._workers) == 1 and pool._workers[0].process.poll() is None
        assert pool.entries(data) == entries_of(data) and handed == [data]  # now to a worker
    finally:
        pool.close()
    assert all(worker.process.returncode is not None for worker in pool._workers)


def test_a_closed_pool_decodes_here() -> None:
    pool = Ingest(1)
    pool.start()
    worker = pool._workers[0]
    pool.close()
    assert worker.process.returncode is not None  # ended, and reaped
    data = payload("grpo_group.trxp")
    assert pool._in_worker(data) == entries_of(data) and pool.entries(data) == entries_of(data)


def test_a_pool_left_open_at_exit_starts_no_new_process() -> None:
    """A pool no one closed is closed as the interpreter exits (its workers ignore the SIGTERM
    multiprocessing ends them with then), and its watch must not take that for a death and start
    a process in an interpreter that is exiting."""
    code = (
        "import logging; logging.basicConfig(); from expbuf.server.rpc.push.ingest import Ingest; "
        "pool = Ingest(1); pool.start()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "starting a new one" not in done.stderr, done.stderr


START = """
import sys
from expbuf.server.rpc.push.ingest import Ingest
sys.executable = sys.argv[1]  # what the pool starts its workers with
Ingest(2).start()
"""

# A Python that starts once: the first worker started with it lives, the second exits before it is ready.
ONCE = """#!/bin/sh
mkdir "$0.flag" 2>/dev/null || exit 3
exec {python} "$@"
"""


def test_a_pool_that_fails_to_start_ends_the_workers_it_started(tmp_path: Path) -> None:
    """One worker of two dies as it starts: the pool's start fails, and the worker started beside
    it ends, though the failure is the interpreter's last (which keeps the pool referenced) and
    the worker ignores the SIGTERM a stop would send it."""
    script, python = tmp_path / "start.py", tmp_path / "python-once"
    script.write_text(START)
    python.write_text(ONCE.format(python=sys.executable))
    python.chmod(0o755)
    done = subprocess.run([sys.executable, str(script), str(python)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Ingest(2).start()" in done.stderr, (
        done.stderr
    )  # the failure, told by its traceback
    assert "EOFError" in done.stderr, done.stderr  # the second worker's connection ended before it was ready


def test_concurrent_pushes_each_get_their_own_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushes decoded at once, here and in workers, each get their payload's entries."""
    monkeypatch.setattr(ingest_module, "SMALL", 0)  # the fixtures are small: hand them off all the same
    names = sorted(MANIFEST["payloads"]) * 6
    pool = Ingest(2)
    pool.start()
    try:
        with ThreadPoolExecutor(6) as threads:
            got = list(threads.map(lambda name: pool.entries(payload(name)), names))
    finally:
        pool.close()
    assert got == [entries_of(payload(name)) for name in names]


def test_the_default_leaves_the_server_one_core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """By default one ingest process per core but one (the server's own process decodes too),
    at least 1 and at most 4; a configured number, 0 included, is taken as it is."""
    for cores, want in ((1, 1), (2, 1), (3, 2), (8, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert ServerConfig(data=str(tmp_path)).ingest_workers == want, cores
    assert ServerConfig(data=str(tmp_path), ingest_processes=0).ingest_workers == 0
    assert ServerConfig(data=str(tmp_path), ingest_processes=3).ingest_workers == 3
    with pytest.raises(ConfigError, match="ingest_processes must be an integer from 0 to 64"):
        ServerConfig(data=str(tmp_path), ingest_processes=-1)


def test_an_empty_payload_is_refused_without_losing_the_worker() -> None:
    """The first payload a worker gets may be empty: it is refused as here, and the worker
    (whose region had never been mapped) stays."""
    pool = Ingest(1)
    pool.start()
    try:
        worker = pool._workers[0]
        with pytest.raises(Exception) as here:
            entries_of(b"")
        with pytest.raises(type(here.value)) as there:
            pool._in_worker(b"")
        assert str(there.value) == str(here.value)
        assert pool._workers[0] is worker and worker.process.poll() is None
    finally:
        pool.close()


def test_a_refusal_then_a_push_that_grows_the_region_decode_as_here(ingest: Ingest) -> None:
    """A worker decodes each payload where the server put it in the region (views of it, not a
    copy): after a refused one, the region grows (is mapped again) for the next, larger push as for
    any, and that push's entries are whole. (That the refusal's views go with its reply, so that the
    old map is unmapped at once rather than when a collector frees them, this does not tell.)"""
    worker = ingest._workers[0]
    bad = (BAD_DIR / "prompt_longer_than_tokens.bin").read_bytes()
    assert isinstance(worker.entries(bad), InvalidPayload)  # the refusal, as the worker gives it
    tokens = worker.region.size // 4
    big = trxp.encode(
        Experience(eid=EID(batch="g", task=0, run=run), tokens=torch.arange(tokens, dtype=torch.int32), prompt_length=1)
        for run in range(2)
    )
    size = worker.region.size
    assert worker.entries(big) == entries_of(big)
    assert worker.region.size > size
    assert worker.process.poll() is None


def test_a_region_grows_while_a_view_of_its_map_is_held(tmp_path: Path) -> None:
    """A view of the map still held (one a collector has yet to free) does not stop the region
    from growing: the old map goes when the view does, and the view reads what it did."""
    region = ingest_worker.Region(os.open(tmp_path / "region", os.O_RDWR | os.O_CREAT))
    try:
        region.fit(16)[:4] = b"kept"
        held = memoryview(region.map)[:4]
        grown = region.fit(region.size + 1)
        assert grown is region.map and region.size > 16 and bytes(held) == b"kept" == grown[:4]
        held.release()
    finally:
        region.close()


def test_an_entry_is_placed_from_a_worker_s_row_field_by_field() -> None:
    """Entry.placed reads a worker's row in the order of the entry's fields (ingest_worker.FIELDS):
    each field, given a value of its own, is found where it was given."""
    row = tuple(f"value of {name}" for name in ingest_worker.FIELDS)
    entry = Entry.placed(row, b"payload")
    for name, value in zip(ingest_worker.FIELDS, row, strict=True):
        assert getattr(entry, name) == (b"payload" if name == "blob" else value), name


def metadata_payload(sizes: list[int]) -> bytes:
    """Experiences of 4 tokens, each carrying `size` bytes in its info (a bytes value)."""
    return trxp.encode(
        Experience(
            eid=EID(batch="m", task=task, suffix="s"),
            tokens=torch.arange(4, dtype=torch.int32),
            prompt_length=1,
            reward=1.0,
            info={"blob": bytes(size)},
        )
        for task, size in enumerate(sizes)
    )


def test_an_experience_whose_metadata_passes_max_metadata_bytes_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = metadata_payload([1000, 300_000])
    pool = Ingest(1, max_metadata_bytes=256 << 10)
    pool.start()
    try:
        refusals = []
        for decode in (pool.entries, pool._in_worker):  # here, and in a worker process
            with pytest.raises(InvalidPayload) as refused:
                decode(data)
            refusals.append(str(refused.value))
    finally:
        pool.close()
    assert refusals[0] == refusals[1]
    assert refusals[0].startswith("item 1 (uid m/1/0/0/s): its metadata takes 300"), refusals[0]
    assert "max_metadata_bytes = 262144" in refusals[0] and "EXPBUF_MAX_METADATA_BYTES" in refusals[0]
    assert [entry.uid for entry in Ingest(0, max_metadata_bytes=512 << 10).entries(data)] == ["m/0/0/0/s", "m/1/0/0/s"]
    with pytest.raises(ConfigError, match="max_metadata_bytes must be an integer >= 65536"):
        ServerConfig(data=str(tmp_path), max_metadata_bytes=1000)
    assert ServerConfig(data=str(tmp_path)).max_metadata_bytes == 8 << 20
    monkeypatch.setenv("EXPBUF_MAX_METADATA_BYTES", str(1 << 20))
    assert load(None).max_metadata_bytes == 1 << 20


def test_a_push_past_max_metadata_bytes_is_refused_and_the_server_goes_on(start_server: Servers) -> None:
    server = start_server(ingest_processes=1, max_metadata_bytes=256 << 10)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        with pytest.raises(BufferError) as refused:
            client.push(metadata_payload([300_000]))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "item 0 (uid m/0/0/0/s)" in refused.value.details, refused.value.details
        assert "max_metadata_bytes = 262144" in refused.value.details
        assert client.stats("default")["default"].pushed == 0
        assert client.push(metadata_payload([200_000])).stored == ["m/0/0/0/s"]


def traced_decode(data: bytes) -> tuple[int, int]:
    """What entries_of(data) allocates at its peak, and what stays allocated once its entries are let go."""
    entries_of(data)  # this thread's first decode made what it keeps for every other
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        entries = entries_of(data)
        peak = tracemalloc.get_traced_memory()[1]
        del entries
        return peak - base, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def test_decoding_metadata_holds_the_packed_copy_and_one_experience_s_metadata_beside_the_payload() -> None:
    """An experience's metadata is unpickled once, without a copy of the pickle first, and let
    go once packed: a payload of many experiences holds about one packed copy more, one of a
    single experience two (its metadata as objects, then packed). Nothing stays after."""
    many = metadata_payload([1 << 20] * 8)
    peak, after = traced_decode(many)
    assert peak < len(many) + (3 << 20), peak / len(many)
    assert after < 1 << 20, after
    one = metadata_payload([8 << 20])
    peak, after = traced_decode(one)
    assert peak < 2 * len(one) + (1 << 20), peak / len(one)
    assert after < 1 << 20, after
