"""Keyed values (PutValues, GetValues, ClearValues; server/store/services/values.py): bytes under
names of the caller's own, durable when the put returns, read back as stored, cleared, dropped
with their table; bad requests refused by name with nothing stored. A real server on loopback,
real LMDB, restarted on its data."""

from __future__ import annotations

import asyncio

import pytest

from expbuf.client import AsyncBufferClient, BufferClient, InvalidArgumentError, NotFoundError
from expbuf.client.errors import ResourceExhaustedError

from conftest import Servers


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


def test_a_read_larger_than_a_message_is_refused_naming_the_bound(start_server: Servers) -> None:
    server = start_server(max_message_bytes=1 << 20)
    with BufferClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, push_chunk_bytes=0) as client:
        client.create_table("kv")
        for at in range(3):
            client.put_values([f"big{at}"], [bytes(600_000)], "kv")
        with pytest.raises(ResourceExhaustedError, match="ask for fewer keys"):
            client.get_values(["big0", "big1", "big2"], "kv")
        assert client.get_values(["big1"], "kv") == [bytes(600_000)]
