"""A table that compresses (`compression = "zstd"`) keeps tensor data larger than 256 KiB
(chunked.MIN_COMPRESSED) as zstd frames, whichever way the push came (in one message, or in
chunks staged as they arrive), and serves every read the bytes as pushed; its settings travel
and are checked by name; a table that does not compress is stored, and sent, as earlier
releases did."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch
import zstandard

from expbuf.client import BufferClient, Experience, InvalidArgumentError, trxp
from expbuf.client.rpc import wire
from expbuf.client.rpc.wire import WireError
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.disk import chunk_heads, chunked, zstd_workers
from expbuf.server.store.schema.errors import ConfigError
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items, make_experience, take, wait_for

RESPONSE = 700_000  # tokens int32, log-probs float32, a bool mask: about 6.3 MB a section


def same(got: Experience, want: Experience) -> bool:
    """The tensors pushed, read back (a read adds the advantages computed since)."""
    return all(torch.equal(getattr(got, name), getattr(want, name)) for name in ("tokens", "logprobs", "action_mask"))


def rows(env: lmdb.Environment, db: lmdb._Database) -> dict[bytes, bytes]:
    with env.begin() as txn, txn.cursor(db=db) as cur:
        return {bytes(key): bytes(value) for key, value in cur}


def stored_frames(store: Store) -> dict[bytes, bytes]:
    """The chunks a store keeps, without the marks naming each set's experience (chunk_heads.OWNER)."""
    chunks = rows(store.environment.env, store.db["chunks"])
    return {key: value for key, value in chunks.items() if key[12:] != chunk_heads.OWNER.to_bytes(4, "big")}


def test_a_compressing_table_keeps_its_chunks_as_frames_and_serves_the_bytes_pushed(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    whole = [make_experience("b", 0, run, response=RESPONSE) for run in range(2)]
    staged = [make_experience("b", 1, run, response=RESPONSE) for run in range(2)]
    for exp in (*whole, *staged):  # log-probs that compress as real ones do, hardly at all
        exp.logprobs = torch.randn(RESPONSE)
    with (
        BufferClient(target, timeout=60) as client,
        BufferClient(target, timeout=60, push_chunk_bytes=1 << 20) as chunks,
    ):
        info = client.create_table("z", group_size=2, estimator="grpo", compression="zstd", compression_level=3)
        assert (info.compression, info.compression_level) == ("zstd", 3)
        assert client.push(whole, table="z").stored == [exp.eid.uid for exp in whole]  # in one message
        assert chunks.push(staged, table="z").stored == [exp.eid.uid for exp in staged]  # staged as it came
        store = server.store
        heads = rows(store.environment.env, store.db["blobs"])
        assert len(heads) == 4 and {head[:4] for head in heads.values()} == {chunk_heads.ZSTD_MAGIC}
        frames = stored_frames(store)
        plain = sum(len(zstandard.ZstdDecompressor().decompress(frame)) for frame in frames.values())
        sections = sum(len(t.data) for exp in (*whole, *staged) for t in trxp.from_experience(exp).tensors.values())
        assert plain == sections and sum(map(len, frames.values())) < 0.75 * sections
        assert store.verify("z") == []

        pushed = {exp.eid.uid: exp for exp in (*whole, *staged)}
        got = client.get(list(pushed), table="z")
        assert len(got) == 4 and all(same(exp, pushed[exp.eid.uid]) for exp in got)
        fields = client.read_fields(list(pushed), ["tokens"], table="z", share=1, of=2)
        for at, exp in enumerate(pushed.values()):  # a rank's share: only the chunks it lies in are read
            tokens = fields.columns["tokens"]
            assert torch.equal(
                tokens.values[tokens.offsets[at] : tokens.offsets[at + 1]], exp.tokens[exp.tokens.numel() // 2 :]
            )
        stream = client.sample("z", num_groups=2, timeout=10, delivery="consume")
        batch = next(stream)
        stream.close()
        assert sorted(exp.eid.uid for exp in batch.experiences) == sorted(pushed)
        assert all(same(exp, pushed[exp.eid.uid]) for exp in batch.experiences)
        wait_for(lambda: rows(store.environment.env, store.db["chunks"]) == {}, "the consumed batch's frames to go")


def test_compression_settings_travel_and_are_checked_by_name(client: BufferClient) -> None:
    assert client.create_table("plain").compression == "none"
    info = client.create_table("z", compression="zstd")
    assert (info.compression, info.compression_level) == ("zstd", 1)
    with pytest.raises(WireError, match="compression is 'lz4'; expected one of none, zstd"):  # the client's
        client.create_table("bad", compression="lz4")  # type: ignore[typeddict-item]
    with pytest.raises(InvalidArgumentError, match="compression_level must be an integer from 1 to 19"):
        client.create_table("bad", compression="zstd", compression_level=20)
    assert [t.name for t in client.list_tables()].count("bad") == 0
    with pytest.raises(ConfigError, match="compression_level must be an integer from 1 to 19, got 0"):
        TableConfig.of("t", compression="zstd", compression_level=0)
    with pytest.raises(InvalidArgumentError, match="compression_level 5 needs compression = 'zstd'"):
        client.create_table("bad", compression_level=5)  # not stored, so not kept across a restart
    assert client.create_table("plain", compression_level=1, exist_ok=True).compression == "none"
    # a table that does not compress is stored as earlier releases stored it, which open it
    assert "compression" not in TableConfig.of("t").to_stored()
    stored = TableConfig.of("t", compression="zstd", compression_level=5).to_stored()
    assert (stored["compression"], stored["compression_level"]) == ("zstd", 5)
    assert TableConfig.from_stored(stored).storage.zstd_level == 5


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_compressing_table_keeps_a_section_over_256_kib_as_one_frame(tmp_path: Path, compression: str) -> None:
    """Rollouts of a few thousand tokens with their routing ids are 1-4 MiB: a compressing table
    keeps such a section as a head and one frame; one that does not, whole; both serve it as
    pushed, and a consume and a delete take its frame with it."""
    config = TableConfig.of("t", group_size=2, estimator="grpo", compression=compression)  # type: ignore[arg-type]
    items = [*group_items("mid", 0, 2, response=100_000), *group_items("mid", 1, 2, response=100_000)]
    assert all(chunked.MIN_COMPRESSED < len(trxp.pack_item(item)) < chunk_heads.CHUNK_BYTES for item in items)
    with Store(tmp_path / "data", seed=1) as store:
        store.create_table(config)
        store.put("t", items)
        AdvantageWorker(store).run_once()
        heads = rows(store.environment.env, store.db["blobs"])
        frames = stored_frames(store)
        if compression == "zstd":
            assert {head[:4] for head in heads.values()} == {chunk_heads.ZSTD_MAGIC} and len(frames) == 4
            sections = sum(len(t.data) for item in items for t in item.tensors.values())
            assert sum(map(len, frames.values())) < sections / 2
        else:
            assert not any(chunk_heads.is_head(head) for head in heads.values()) and frames == {}
        got = store.get("t", [item.uid for item in items])
        for item in items:
            (read,) = trxp.parse(got[item.uid])
            assert {name: bytes(t.data) for name, t in read.tensors.items() if name != "advantages"} == {
                name: bytes(t.data) for name, t in item.tensors.items()
            }
        batch = take(store, "t", num_groups=1, delivery="consume")
        assert batch is not None and len(trxp.parse(batch.payload)) == 2
        batch.release()
        assert store.delete("t", group_ids=[next(i.eid.tid for i in items if i.eid.tid != batch.group_ids[0])]) == 2
        for db in ("chunks", "blobs"):
            assert rows(store.environment.env, store.db[db]) == {}, db
        assert store.verify("t") == []


def test_a_table_that_does_not_compress_goes_on_the_wire_as_before() -> None:
    """A server that predates the setting refuses a table whose message carries its fields (an
    unknown setting field), and makes none: only a table that compresses sends them."""

    def sent(settings: dict[str, object]) -> set[str]:
        return {field.name for field, _ in wire.table_to_proto({"name": "t", **settings}).ListFields()}

    assert not {"compression", "compression_level"} & (sent({}) | sent({"compression": "none"}))
    assert {"compression", "compression_level"} <= sent({"compression": "zstd", "compression_level": 3})


def test_the_threads_that_compress_serve_each_call_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call has at most as many chunks in the shared pool as it has threads, so a small push to
    one table does not wait behind all of a large push's chunks to another (a level-19 push held a
    level-1 push 10 s): the second call's chunks are done before the first call's last ones."""
    monkeypatch.setattr(zstd_workers, "_cores", lambda: 2)
    workers = zstd_workers.Workers("expbuf-test-turns")
    done: list[str] = []
    started = threading.Event()

    def slow(name: str) -> str:
        if name == "a5":  # the first call is well under way: every chunk of it handed to the pool, as it was
            started.set()
        time.sleep(0.02)
        done.append(name)
        return name

    first = threading.Thread(target=workers.each, args=(slow, [f"a{i}" for i in range(20)]))
    first.start()
    assert started.wait(10)
    assert workers.each(lambda name: done.append(name) or name, ["b0", "b1"]) == ["b0", "b1"]
    first.join(30)
    assert len(done) == 22 and done.index("b1") < len(done) - 10  # not after all of the first call's


def test_the_threads_are_as_many_as_the_cores_where_the_platform_cannot_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where os has no sched_getaffinity (macOS, the BSDs), every core of the machine counts."""
    monkeypatch.delattr(os, "sched_getaffinity")
    assert zstd_workers._cores() == (os.cpu_count() or 1)
    assert zstd_workers.Workers("expbuf-test-cores").each(lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]
