"""Keyed values (PutValues, GetValues, ClearValues; server/store/services/values.py): bytes under
names of the caller's own, durable when the put returns, read back as stored, cleared, dropped
with their table; bad requests refused by name with nothing stored. A real server on loopback,
real LMDB, restarted on its data."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import lmdb
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, InvalidArgumentError, NotFoundError
from expbuf.client.errors import PermissionDeniedError, ResourceExhaustedError
from expbuf.client.schema.call_limits import MAX_KEYS_PER_CALL
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.tables import integrity

from conftest import Servers
from helpers import make_experience, scrape


def test_values_are_stored_read_replaced_and_cleared_across_a_restart(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("kv")
        assert client.put_values(["0@tokens", "0@mask", "1@tokens"], [b"abc", b"\x00\x01", bytes(5000)], "kv") == 3
        assert client.get_values(["1@tokens", "absent", "0@tokens"], "kv") == [bytes(5000), None, b"abc"]
        assert client.put_values(["0@tokens"], [b"replaced"], "kv") == 1
    server.stop(grace=1)
    server = start_server()  # the same data: what was acknowledged is there
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        assert client.get_values(["0@tokens", "0@mask", "1@tokens"], "kv") == [b"replaced", b"\x00\x01", bytes(5000)]
        assert client.clear_values(["0@tokens", "absent"], "kv") == 1
        assert client.get_values(["0@tokens", "0@mask"], "kv") == [None, b"\x00\x01"]

        async def run() -> list[bytes | None]:
            async with AsyncBufferClient(f"127.0.0.1:{server.port}") as aio:
                assert await aio.put_values(["2@x"], [b"async"], "kv") == 1
                got = await aio.get_values(["2@x", "0@mask"], "kv")
                assert await aio.clear_values(["2@x"], "kv") == 1
                return got

        assert asyncio.run(run()) == [b"async", b"\x00\x01"]
        assert client.drop_table("kv") >= 0
        client.create_table("kv")
        assert client.get_values(["0@mask"], "kv") == [None]  # dropped with the table


def test_bad_requests_are_refused_by_name_and_store_nothing(client: BufferClient) -> None:
    client.create_table("kv")
    with pytest.raises(InvalidArgumentError, match="named more than once"):
        client.put_values(["a", "b", "a"], [b"1", b"2", b"3"], "kv")
    with pytest.raises(InvalidArgumentError, match="is not a key"):
        client.put_values(["ok", ""], [b"1", b"2"], "kv")
    with pytest.raises(InvalidArgumentError, match="is not a key"):
        client.put_values(["ok", "k" * 401], [b"1", b"2"], "kv")
    with pytest.raises(ValueError, match="2 keys for 1 values"):
        client.put_values(["a", "b"], [b"1"], "kv")
    assert client.get_values(["a", "b", "ok"], "kv") == [None, None, None]  # none of them stored
    with pytest.raises(NotFoundError, match="nowhere"):
        client.put_values(["a"], [b"1"], "nowhere")
    assert client.put_values(["a"], [b"1"], "kv") == 1  # the server serves on


def test_more_keys_than_a_call_carries_are_read_in_calls_of_their_own(client: BufferClient) -> None:
    """put_values and clear_values split their keys into calls of MAX_KEYS_PER_CALL, get_values sent
    them in one, which the server refused past 65,536 saying the clients split them (the second
    limits audit: TransferQueue's backend put 70,000 keys and could not read them back)."""
    client.create_table("kv")
    keys = [f"k{i}" for i in range(MAX_KEYS_PER_CALL + 10)]
    assert client.put_values(keys, [key.encode() for key in keys], "kv") == len(keys)
    asked = [*keys[::-1], "absent"]
    assert client.get_values(asked, "kv") == [*(key.encode() for key in keys[::-1]), None]

    async def read() -> list[bytes | None]:
        async with AsyncBufferClient(client.target) as aclient:
            return await aclient.get_values(keys, "kv")

    assert asyncio.run(read()) == [key.encode() for key in keys]


def test_a_read_larger_than_a_message_is_refused_naming_the_bound(start_server: Servers) -> None:
    server = start_server(max_message_bytes=1 << 20)
    with BufferClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, push_chunk_bytes=0) as client:
        client.create_table("kv")
        for at in range(3):
            client.put_values([f"big{at}"], [bytes(600_000)], "kv")
        with pytest.raises(ResourceExhaustedError, match="ask for fewer keys"):
            client.get_values(["big0", "big1", "big2"], "kv")
        assert client.get_values(["big1"], "kv") == [bytes(600_000)]


def held(client: BufferClient, table: str) -> tuple[int, int]:
    """A table's keyed values as Stats counts them: how many, and their bytes (key and value)."""
    stats = client.stats(table)[table]
    return stats.values, stats.value_bytes


def test_values_count_in_stats_and_metrics_and_against_the_table_s_capacity(start_server: Servers) -> None:
    """Values take the table's capacity_bytes with its experiences: a put that would pass it is
    refused by name (RESOURCE_EXHAUSTED, table_full) and stores nothing, and Stats, the metrics and
    a restart count them (each its key's and its value's bytes)."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("tq", capacity_bytes=1 << 20)
        client.put_values(["0@a", "1@a", "2@a"], [bytes(300_000)] * 3, "tq")
        assert held(client, "tq") == (3, 3 * (3 + 300_000))
        with pytest.raises(ResourceExhaustedError, match=r"table 'tq'.* capacity_bytes \(1048576\)") as refused:
            client.put_values(["3@a", "4@a"], [b"small", bytes(200_000)], "tq")
        assert refused.value.reason == "table_full"
        assert client.get_values(["3@a", "4@a"], "tq") == [None, None]  # nothing of the put
        with pytest.raises(ResourceExhaustedError, match="on their own"):
            client.put_values(["big"], [bytes(2 << 20)], "tq")
        client.put_values(["0@a"], [b"replaced"], "tq")  # a smaller value in its place makes room
        client.put_values(["3@a"], [bytes(200_000)], "tq")
        assert held(client, "tq") == (4, 4 * 3 + 8 + 2 * 300_000 + 200_000)
        assert client.clear_values(["1@a", "absent"], "tq") == 1
        assert held(client, "tq") == (3, 3 * 3 + 8 + 300_000 + 200_000)
        metrics = scrape(server.metrics_port)
        assert metrics[("expbuf_values", (("table", "tq"),))] == 3
        assert metrics[("expbuf_value_bytes", (("table", "tq"),))] == 3 * 3 + 8 + 300_000 + 200_000
        assert client.stats("tq")["tq"].bytes == 0  # the experiences' bytes, as before
    server.stop(grace=1)
    server = start_server(max_wait_seconds=0.5)  # a push into the full table waits this long for room
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        assert held(client, "tq") == (3, 3 * 3 + 8 + 300_000 + 200_000)
        with pytest.raises(ResourceExhaustedError, match="is full") as full:  # an experience's push: one capacity
            client.push([make_experience(0, 0, 0, response=80_000)], table="tq")
        assert full.value.reason == "table_full"
        assert client.drop_table("tq") == 0
        client.create_table("tq")
        assert held(client, "tq") == (0, 0)


def test_values_stored_before_they_were_counted_are_counted_at_the_start(start_server: Servers) -> None:
    """A directory whose values an earlier release stored (no record beside each value, no value
    counters): the start counts them, and from then on puts and clears keep the count."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("old")
        client.put_values(["a", "bb"], [b"12345", bytes(1000)], "old")
    server.stop(grace=1)
    as_an_earlier_release_left_it(start_server.data)
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        assert held(client, "old") == (2, 1 + 5 + 2 + 1000)
        assert client.put_values(["a", "c"], [b"1", b"22"], "old") == 2
        assert client.clear_values(["bb"], "old") == 1
        assert held(client, "old") == (2, 1 + 1 + 1 + 2)
    server.stop(grace=1)
    with Store(start_server.data) as store:
        assert store.verify("old") == []


def as_an_earlier_release_left_it(data: Path) -> None:
    """The data directory's values as a release before value records wrote them: only the values,
    and table counters without `values` and `value_bytes`."""
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    try:
        kv, counters = env.open_db(b"kv"), env.open_db(b"counters")
        with env.begin(write=True) as txn:
            records = [bytes(key) for key, _ in txn.cursor(db=kv) if bytes(key)[4:5] == b"\xff"]
            assert records  # this release keeps one beside each value
            for key in records:
                txn.delete(key, db=kv)
            for key, raw in list(txn.cursor(db=counters)):
                stored = json.loads(raw) if len(key) == 4 else None
                if isinstance(stored, dict):
                    stored.pop("values", None)
                    stored.pop("value_bytes", None)
                    txn.put(key, json.dumps(stored).encode(), db=counters)
    finally:
        env.close()


TOKENS = {
    "job": frozenset({"push", "sample"}),
    "intruder": frozenset({"push"}),
    "reader": frozenset({"sample"}),
    "ops": frozenset({"push", "sample", "admin"}),
}


def test_a_value_belongs_to_the_token_that_wrote_it(start_server: Servers) -> None:
    """With tokens on, a value is its writer's, as a lease or a claim is: another token's put or
    clear of it is refused (PERMISSION_DENIED, reason forbidden) and changes nothing, its own
    token replaces and clears it, and any token of the sample scope reads it. A reader that
    trusts only its own token's values (only_own) is refused another's, by name."""
    server = start_server(tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="ops") as ops:
        ops.create_table("tq")
    with (
        BufferClient(target, token="job") as job,
        BufferClient(target, token="intruder") as intruder,
        BufferClient(target, token="reader") as reader,
    ):
        job.put_values(["0@input_ids", "controller/head"], [b"ids", b"head"], "tq")
        refused = {
            "'0@input_ids'": lambda: intruder.put_values(["mine", "0@input_ids"], [b"x", b"P..."], "tq"),
            "'controller/head'": lambda: intruder.clear_values(["controller/head"], "tq"),
        }
        for key, call in refused.items():
            with pytest.raises(PermissionDeniedError, match=f"keys: {key} holds a value another token wrote") as denied:
                call()
            assert denied.value.reason == "forbidden"
        assert reader.get_values(["0@input_ids", "controller/head", "mine"], "tq") == [b"ids", b"head", None]
        job.put_values(["0@input_ids"], [b"ids, again"], "tq")  # its writer's token replaces it
        assert job.clear_values(["controller/head"], "tq") == 1  # and clears it
        intruder.put_values(["controller/head"], [b"squatted"], "tq")  # a key no token holds: any writer's
        assert reader.get_values(["controller/head"], "tq") == [b"squatted"]
        with pytest.raises(PermissionDeniedError, match="'controller/head' holds a value another token wrote"):
            job.get_values(["0@input_ids", "controller/head"], "tq", only_own=True)
        assert job.get_values(["0@input_ids", "absent"], "tq", only_own=True) == [b"ids, again", None]

        async def own() -> list[bytes | None]:
            async with AsyncBufferClient(target, token="reader") as aio:
                return await aio.get_values(["controller/head"], "tq", only_own=True)

        with pytest.raises(PermissionDeniedError, match="another token wrote"):  # the asyncio client's too
            asyncio.run(own())
        assert held(reader, "tq") == (2, len("0@input_ids") + 10 + len("controller/head") + 8)
    server.stop(grace=1)
    server = start_server()  # the same data without tokens: no token, so every value is everyone's
    with BufferClient(f"127.0.0.1:{server.port}") as anyone:
        assert anyone.clear_values(["0@input_ids", "controller/head"], "tq") == 2


def test_a_damaged_value_record_is_named_by_the_check(tmp_path: Path) -> None:
    """A value whose record is cut short, or says another size than the value's: `expbuf check`'s
    scan names each as what it is (a cut record was named by struct's unpack error)."""
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of(name="kv"))
        store.put_values("kv", ["a", "b"], [b"12345", b"678"])
        prefix = layout.table_prefix(store.catalog.lookup("kv")[0])

        def damage(txn: lmdb.Transaction[bytes]) -> None:
            txn.put(prefix + b"\xffa", b"\x00\x01", db=store.db["kv"])

        store.environment.submit(damage)
        with store.environment.read() as txn:
            problems = integrity.scan(txn, store.db, 0.0)["kv"]
        assert problems == ["reading it raised ValueError: a value record of 2 bytes, not at least 8"]
        store.environment.submit(lambda txn: txn.put(prefix + b"\xffa", b"\x00" * 7 + b"\x09", db=store.db["kv"]))
        with store.environment.read() as txn:
            assert integrity.scan(txn, store.db, 0.0)["kv"] == ["keyed value b'a' is 5 bytes, its record says 9"]
