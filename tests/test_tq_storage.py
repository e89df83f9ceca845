"""expbuf as TransferQueue's storage backend (client/transferqueue/storage.py), driven by
TransferQueue's own API on a local Ray cluster (its controller a Ray actor, as verl runs it):
`tq.init` with `backend.storage_backend = "Expbuf"`, then TransferQueue's kv_batch_put,
kv_batch_get and kv_clear. Every (sample, field) lands in an expbuf table as a keyed value; the
expbuf server restarted on its data serves them again. A real server on loopback, real LMDB."""

from __future__ import annotations

import pickle
import re
import threading
from collections import OrderedDict
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from test_tq_controller import Hostile
from test_values import held

from expbuf.client import BufferClient, BufferError
from expbuf.client.errors import PermissionDeniedError, UnavailableError

from conftest import Servers
from pages import code_blocks, section


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global tq, OmegaConf, NonTensorStack, TensorDict, ExpbufStorageClient, cuts, decode, encode, expected_bytes
    import test_tq_controller

    test_tq_controller.import_frameworks()
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from tensordict import NonTensorStack, TensorDict

    from expbuf.client.transferqueue.storage import (
        ExpbufStorageClient,
        cuts,
        decode,
        encode,
        expected_bytes,
    )


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.linspace(0, 1, 5, dtype=torch.bfloat16),
        torch.tensor(7.5),
        torch.zeros(0, 3, dtype=torch.float32),
        torch.arange(10)[::2],  # not contiguous
        torch.ones(4, dtype=torch.bool),
        "a prompt's text",
        [1, "two", {"three": 3}],
        {"messages": [{"role": "user", "content": "hi"}], "score": 0.5, "tags": ("a", "b"), "seen": {1, 2}},
        None,
        (True, 7, -2.5, 1 + 2j, b"\x00raw", bytearray(b"x"), frozenset({"f"})),
        OrderedDict(a=1, b=[None]),
        np.array([[1, 2], [3, 4]], dtype=np.int32),
        np.array(["a", {"k": 1}, None], dtype=object),
        np.array(["x", "yz"]),
        [np.float32(1.5), np.str_("s"), np.int64(3), np.dtype("float16")],
        {"pixel_values": torch.ones(2, 3), "shape": torch.Size([2, 3]), "dtype": torch.bfloat16},
    ],
    ids=str.split(
        "int64 bf16 scalar empty strided bool str list chat none atoms ordered ndarray objects strings numpy-scalars "
        "nested-tensor"
    ),
)
def test_a_value_comes_back_as_stored(value: object) -> None:
    """What TransferQueue stores (tensors, and a NonTensorStack's items: strings, numbers, None,
    lists, dicts, numpy arrays and scalars, tensors inside them) reads back as it was."""
    back = decode(encode(value))
    assert same(back, value), (back, value)
    with pytest.raises(ValueError, match="did not write"):
        decode(b"X" + encode(value)[1:])


def same(back: object, value: object) -> bool:
    """Whether a value read back is the one stored: of its type, and equal, array by array."""
    if type(back) is not type(value):
        return False
    if isinstance(value, torch.Tensor):
        assert isinstance(back, torch.Tensor)
        return back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value)
    if isinstance(value, np.ndarray):
        assert isinstance(back, np.ndarray)
        return back.dtype == value.dtype and back.shape == value.shape and back.tolist() == value.tolist()
    if isinstance(value, (list, tuple)):
        assert isinstance(back, (list, tuple))
        return len(back) == len(value) and all(same(b, v) for b, v in zip(back, value, strict=True))
    if isinstance(value, dict):
        assert isinstance(back, dict)
        return back.keys() == value.keys() and all(same(back[k], value[k]) for k in value)
    return back == value


class Prompt:
    """A type of the user's own, which a stored pickle would have to name to be loaded."""


def test_a_value_of_a_type_the_backend_does_not_load_back_is_refused_at_the_put_by_name() -> None:
    for value in (Prompt(), [1, {"x": Prompt}], len, [torch.nn.Parameter(torch.ones(1))]):
        with pytest.raises(TypeError, match=r"stores None, booleans, .* not (test_tq_storage\.Prompt|builtins|torch)"):
            encode(value)


def rows(column: torch.Tensor) -> list:
    """A column TransferQueue returns (per-sample tensors, nested or stacked) as lists."""
    return [row.tolist() for row in (column.unbind() if column.is_nested else column)]


def test_transfer_queue_stores_every_field_in_expbuf_and_reads_it_after_a_restart(
    ray_cluster: ModuleType, start_server: Servers
) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": "tq"}}}))
    try:
        keys = ["p0", "p1", "p2"]
        fields = TensorDict(
            {
                "input_ids": torch.arange(12).reshape(3, 4),
                "score": torch.tensor([0.5, 1.0, -1.0]),
                "text": NonTensorStack("a", "b", "c"),
            },
            batch_size=3,
        )
        tq.kv_batch_put(keys=keys, partition_id="train", fields=fields)
        with BufferClient(target) as client:  # TransferQueue's keys: "{global_index}@{field}", 3 x 3
            stored = client.get_values([f"{i}@{f}" for i in range(3) for f in ("input_ids", "score", "text")], "tq")
        assert all(value is not None for value in stored)

        start_server.stop(server)
        server = start_server(port=server.port)  # the same data and address: the fields are there
        got = tq.kv_batch_get(keys=keys, partition_id="train")
        assert rows(got["input_ids"]) == fields["input_ids"].tolist()
        assert rows(got["score"]) == fields["score"].tolist()
        assert list(got["text"]) == ["a", "b", "c"]

        tq.kv_clear(keys=keys, partition_id="train")
        with BufferClient(target) as client:
            assert client.get_values([f"{i}@input_ids" for i in range(3)], "tq") == [None, None, None]
    finally:
        tq.close()


def test_a_value_of_more_than_half_a_message_is_stored_in_parts_read_whole_and_cleared_with_them(
    ray_cluster: ModuleType, start_server: Servers
) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    backend = {"target": target, "table": "tq_parts", "max_message_bytes": 8 << 20}  # parts of 4 MiB at most
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": backend}}))
    try:
        routing = torch.arange(2 * 2_200_000, dtype=torch.int32).reshape(2, 2_200_000)  # 8.8 MB a sample: 3 parts
        fields = TensorDict({"routing": routing, "score": torch.tensor([1.0, 2.0])}, batch_size=2)
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=fields)
        parts = [f"{i}@routing#{n}" for i in range(2) for n in range(3)]
        with BufferClient(target) as client:
            assert all(value is not None for value in client.get_values(parts, "tq_parts"))
            assert client.get_values(["0@routing#3"], "tq_parts") == [None]
        got = tq.kv_batch_get(keys=["b", "a"], partition_id="train")
        assert rows(got["routing"]) == [routing[1].tolist(), routing[0].tolist()]
        assert got["score"].tolist() == [2.0, 1.0]

        tq.kv_clear(keys=["a", "b"], partition_id="train")
        with BufferClient(target) as client:
            assert client.get_values([*parts, "0@routing", "1@score"], "tq_parts") == [None] * 8
    finally:
        tq.close()


def test_cuts_keep_each_span_within_the_bound_and_a_larger_value_alone() -> None:
    assert cuts([], 10) == []
    assert cuts([4, 4, 4, 12, 1, 0, 9], 10) == [(0, 2), (2, 3), (3, 4), (4, 7)]
    assert expected_bytes(torch.Size([3, 5]), torch.float32) == 3 * 5 * 4 + 64
    assert expected_bytes(None, torch.float32) == expected_bytes([3], None) == 0


def test_a_bad_wait_or_server_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="wait_s must be a number of seconds above 0, got None"):
        ExpbufStorageClient({"target": "127.0.0.1:1", "wait_s": None})
    for config in ({}, {"target": "a:1", "shards": ["b:2"]}):
        with pytest.raises(ValueError, match=r"backend.Expbuf: name the expbuf server as target .* one of them"):
            ExpbufStorageClient(config)
    with pytest.raises(ValueError, match="shards must be a list of host:port"):
        ExpbufStorageClient({"shards": 5})
    for shards in (["a:1", ""], ["a:1", None], {"s0": None}):
        with pytest.raises(ValueError, match="a shard without its host:port"):
            ExpbufStorageClient({"shards": shards})


def test_transfer_queue_over_a_sharded_expbuf_keeps_each_key_on_one_shard(
    ray_cluster: ModuleType, start_server: Servers, tmp_path: Path
) -> None:
    """`backend.Expbuf.shards`: TransferQueue's values and its controller's journal spread over a
    sharded expbuf's servers, each key on the one shard the sharded client places it on, read
    back and cleared through TransferQueue's own API."""
    targets = [f"127.0.0.1:{start_server(tmp_path / f'shard{n}').port}" for n in range(2)]
    backend = {"shards": targets, "table": "tq_shards"}
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": backend}}))
    try:
        keys = [f"k{i}" for i in range(16)]
        fields = TensorDict({"ids": torch.arange(16 * 3).reshape(16, 3), "score": torch.arange(16.0)}, batch_size=16)
        tq.kv_batch_put(keys=keys, partition_id="train", fields=fields)
        names = [f"{i}@{field}" for i in range(16) for field in ("ids", "score")]
        held = []
        for target in targets:
            with BufferClient(target) as client:
                held.append(
                    {name for name, value in zip(names, client.get_values(names, "tq_shards"), strict=True) if value}
                )
        assert held[0] | held[1] == set(names) and not held[0] & held[1]  # each key on one shard
        assert held[0] and held[1]  # 32 keys all on one of two shards: 1 in 2**31
        first = "controller/journal/" + "1".zfill(20)  # the controller's first journal entry: on one shard
        with BufferClient(targets[0]) as one, BufferClient(targets[1]) as other:
            assert [
                one.get_values([first], "tq_shards")[0] is None,
                other.get_values([first], "tq_shards")[0] is None,
            ].count(False) == 1
        got = tq.kv_batch_get(keys=list(reversed(keys)), partition_id="train")
        assert rows(got["ids"]) == list(reversed(fields["ids"].tolist()))
        assert got["score"].tolist() == list(reversed(fields["score"].tolist()))
        tq.kv_clear(keys=keys, partition_id="train")
        for target in targets:
            with BufferClient(target) as client:
                assert client.get_values(names, "tq_shards") == [None] * len(names)
    finally:
        tq.close()
    # Keys are found only over the same shards under the same names: other shards are refused by name.
    for shards in (list(reversed(targets)), targets[:1]):
        with pytest.raises(ValueError, match="each key would be sought on another shard than it was put on"):
            ExpbufStorageClient({"shards": shards, "table": "tq_shards"})
    ExpbufStorageClient({"shards": {"shard-0": targets[0], "shard-1": targets[1]}, "table": "tq_shards"}).close()


def test_a_put_waits_out_a_restart_of_the_server(start_server: Servers) -> None:
    """A put made while the expbuf server is down waits for it (up to backend.Expbuf.wait_s), as
    the controller's journal does, where gRPC's own few retries gave up within seconds."""
    server = start_server()
    port = server.port
    storage = ExpbufStorageClient({"target": f"127.0.0.1:{port}", "table": "tq_wait", "wait_s": 60})
    try:
        start_server.stop(server)  # its port held meanwhile: the put must reach no other server
        events: list[str] = []
        later = threading.Timer(6.0, lambda: (start_server(port=port), events.append("restarted")))
        later.start()
        try:
            storage.put(["0@score"], [torch.tensor([1.5])])
            events.append("put returned")
        finally:
            later.join()
        assert events == ["restarted", "put returned"]
        (value,) = storage.get(["0@score"], shapes=[(1,)], dtypes=[torch.float32])
        assert value.tolist() == [1.5]
    finally:
        storage.close()


def test_a_start_over_a_shard_that_does_not_answer_fails_naming_it(start_server: Servers) -> None:
    live = f"127.0.0.1:{start_server().port}"
    with pytest.raises(BufferError, match=r"shard 'shard-1' \(127\.0\.0\.1:1\) of expbuf table 'tq_down'"):
        ExpbufStorageClient({"shards": [live, "127.0.0.1:1"], "table": "tq_down", "wait_s": 1})


def test_a_hostile_pickle_under_a_sample_s_field_is_refused_by_a_consumer_and_never_runs(
    start_server: Servers, tmp_path: Path
) -> None:
    """A pickle that runs code, put under a sample's field ("0@input_ids") as the backend's own
    pickled values are stored (b"P" and the pickle): a consumer's get refuses it, naming the key,
    and its code never runs; what the backend itself stores reads back."""
    server = start_server()
    marker = tmp_path / "ran"
    storage = ExpbufStorageClient({"target": f"127.0.0.1:{server.port}", "table": "tq"})
    try:
        storage.put(["1@text"], ["a prompt"])
        with BufferClient(f"127.0.0.1:{server.port}") as intruder:
            intruder.put_values(["0@input_ids"], [b"P" + pickle.dumps(Hostile(marker))], "tq")
        with pytest.raises(pickle.UnpicklingError, match=r"0@input_ids.*builtins\.exec, which expbuf's"):
            storage.get(["1@text", "0@input_ids"])
        assert not marker.exists()
        assert storage.get(["1@text"]) == ["a prompt"]
    finally:
        storage.close()


TOKENS = {
    "job": frozenset({"push", "sample"}),
    "ops": frozenset({"push", "sample", "admin"}),
    "intruder": frozenset({"push", "sample"}),
}


def test_the_backend_runs_on_a_push_and_sample_token_over_a_table_that_exists(start_server: Servers) -> None:
    """The backend needs the push and sample scopes where its table exists (used as it is, its
    settings whatever they are), and says what to do where it does not (making one takes the admin
    scope). Its values are its token's: another token can neither replace nor clear them, and a
    key another token put first is refused, never read as the job's."""
    server = start_server(tokens=TOKENS)
    config = {"target": f"127.0.0.1:{server.port}", "table": "tq", "token": "job"}
    with pytest.raises(PermissionDeniedError, match=r"expbuf table 'tq' does not exist .* the admin scope"):
        ExpbufStorageClient(config)
    with BufferClient(config["target"], token="ops") as ops:
        ops.create_table("tq", capacity_bytes=64 << 20)
    storage = ExpbufStorageClient(config)
    try:
        storage.put(["0@ids", "0@text"], [torch.arange(4), "a prompt"])
        with BufferClient(config["target"], token="intruder") as intruder:
            with pytest.raises(PermissionDeniedError, match="another token wrote"):
                intruder.put_values(["0@ids"], [b"P" + pickle.dumps("forged")], "tq")
            with pytest.raises(PermissionDeniedError, match="another token wrote"):
                intruder.clear_values(["0@text"], "tq")
            intruder.put_values(["1@ids"], [b"P" + pickle.dumps("squatted")], "tq")
        assert storage.get(["0@text"]) == ["a prompt"]
        with pytest.raises(PermissionDeniedError, match=r"'1@ids' holds a value another token wrote"):
            storage.get(["1@ids"])  # read as the job's it would be
        with pytest.raises(PermissionDeniedError, match=r"'1@ids' holds a value another token wrote"):
            storage.put(["1@ids"], [torch.arange(2)])
        storage.clear(["0@ids", "0@text"])
    finally:
        storage.close()


def test_a_server_name_that_does_not_resolve_fails_the_start_at_once_in_one_line() -> None:
    """A start whose server's name does not resolve here (the docs' `expbuf:50051` outside the
    docs' network) fails at once, naming the setting, the address and the cause in one line,
    where it waited out wait_s for a server that could never answer."""
    with pytest.raises(UnavailableError) as failed:
        ExpbufStorageClient({"target": "expbuf.invalid:50051", "table": "tq", "wait_s": 600})
    message = str(failed.value)
    assert "\n" not in message and "Deadline Exceeded" not in message, message
    assert re.search(r"backend\.Expbuf: the expbuf server's address expbuf\.invalid:50051 does not resolve", message)


def test_transfer_queue_starts_on_a_push_and_sample_token_and_its_errors_come_through_ray(
    ray_cluster: ModuleType, start_server: Servers
) -> None:
    """tq.init with a push and sample token over a table an admin made: TransferQueue's puts and
    gets run, and the controller's journal with them. A start against a server name that does not
    resolve fails with expbuf's own error, which `except UnavailableError` catches through Ray."""
    server = start_server(tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="ops") as ops:
        ops.create_table("tq")
    backend = {"target": target, "table": "tq", "token": "job"}
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": backend}}))
    try:
        fields = TensorDict({"ids": torch.arange(6).reshape(2, 3), "text": NonTensorStack("a", "b")}, batch_size=2)
        tq.kv_batch_put(keys=["p0", "p1"], partition_id="train", fields=fields)
        got = tq.kv_batch_get(keys=["p1"], partition_id="train")
        assert rows(got["ids"]) == [[3, 4, 5]] and list(got["text"]) == ["b"]
        tq.kv_clear(keys=["p0", "p1"], partition_id="train")
    finally:
        tq.close()
    nowhere = {"target": "expbuf.invalid:50051", "table": "tq"}
    with pytest.raises(UnavailableError, match="does not resolve"):
        tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": nowhere}}))
    tq.close()


def test_the_page_s_first_put_and_get_runs_as_written(
    ray_cluster: ModuleType, start_server: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/frameworks/transferqueue.md's first put and get, as written but for the server's
    address: the sample read back, and the table's values counted in Stats."""
    server = start_server()
    snippet = code_blocks(section("frameworks/transferqueue.md", "## A first put and get"), "python")[0]
    code = snippet.replace("127.0.0.1:50051", f"127.0.0.1:{server.port}")
    exec(compile(code, "frameworks/transferqueue.md", "exec"), {"__name__": "docs"})
    read, counted = capsys.readouterr().out.splitlines()[-2:]
    assert read == "[4, 5, 6, 7] ['3+3?']"
    values, size = map(int, counted.split())
    assert values >= 4 and size > 4 * len("0@input_ids")  # the 4 fields, and the controller's entries


def test_a_clear_of_samples_with_other_fields_each_clears_every_field_stored(
    ray_cluster: ModuleType, start_server: Servers
) -> None:
    """TransferQueue clears a batch of keys by the fields all of them hold; a field only some of
    them hold is cleared too, or its values would count against the table's capacity for ever."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": "tq"}}}))
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=TensorDict({"x": torch.ones(2, 3)}, batch_size=2))
        tq.kv_put(key="a", partition_id="train", fields=TensorDict({"y": torch.zeros(1, 2)}, batch_size=1))
        tq.kv_clear(keys=["a", "b"], partition_id="train")
        with BufferClient(target) as client:
            assert client.get_values(["0@x", "1@x", "0@y"], "tq") == [None] * 3
    finally:
        tq.close()


def test_a_key_put_again_keeps_no_part_of_its_earlier_value(start_server: Servers) -> None:
    """A key stored in parts and put again, whole (beside another key's value in parts, in the
    same put) or in fewer parts, reads back as the new value and keeps none of the earlier parts:
    they took the table's capacity for ever, since a clear clears only the latest put's parts."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    storage = ExpbufStorageClient({"target": target, "table": "tq", "max_message_bytes": 4 << 20})  # parts of 2 MiB
    three, four = torch.arange(1_500_000, dtype=torch.int32), torch.arange(1_000_000, dtype=torch.int64)  # 6, 8 MB
    small = torch.tensor([1.5])
    try:
        assert storage.put(["0@x", "1@x"], [three, small]) == [{"expbuf_parts": 3}, None]
        assert storage.put(["0@x", "1@x"], [small, three]) == [None, {"expbuf_parts": 3}]
        assert storage.put(["2@x"], [torch.arange(2_500_000, dtype=torch.int32)]) == [{"expbuf_parts": 5}]
        assert storage.put(["2@x"], [four]) == [{"expbuf_parts": 4}]
        got = storage.get(["0@x", "1@x", "2@x"])
        assert [torch.equal(value, want) for value, want in zip(got, [small, three, four], strict=True)] == [True] * 3
        with BufferClient(target) as client:
            earlier = ["0@x#0", "0@x#1", "0@x#2", "2@x#4"]
            assert [value is None for value in client.get_values(earlier, "tq")] == [True] * len(earlier)
            assert held(client, "tq")[0] == 3 + 3 + 4  # the keys, 1@x's parts and 2@x's
    finally:
        storage.close()


def test_a_put_again_cut_short_part_way_is_refused_at_the_get_not_read_as_a_mix(start_server: Servers) -> None:
    """A key stored in parts and put again with a value of the same size, the put dying after its
    first part (the key still naming the earlier value's parts): a get must not hand back the new
    first part joined to the earlier value's others, which has the size the key names."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    storage = ExpbufStorageClient({"target": target, "table": "tq", "max_message_bytes": 4 << 20})  # parts of 2 MiB
    earlier, later = torch.arange(1_500_000, dtype=torch.int32), torch.arange(1_500_000, dtype=torch.int32).flip(0)
    try:
        assert storage.put(["0@x"], [earlier]) == [{"expbuf_parts": 3}]
        with BufferClient(target) as client:
            client.put_values(["0@x#0"], [encode(later)[: storage.limit]], "tq")  # what the cut-short put left
        with pytest.raises(ValueError, match=r"0@x.*put of it was cut short"):
            storage.get(["0@x"])
        storage.put(["0@x"], [later])  # put again whole: it reads back
        assert torch.equal(storage.get(["0@x"])[0], later)
    finally:
        storage.close()


def test_a_field_named_as_another_s_part_is_refused_and_a_small_message_bound_is_taken(start_server: Servers) -> None:
    """A field named `a#0` was stored under the key of field `a`'s first part, and the put of `a`
    cleared it (its earlier value's parts): its values were gone, "holds no value" at the get. It is
    refused at the put, naming it. A max_message_bytes below 4 MiB failed the start on a chunk size
    the config cannot give (push_chunk_bytes 4 MiB); the chunks take the bound."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    storage = ExpbufStorageClient({"target": target, "table": "tq", "max_message_bytes": 1 << 20})
    try:
        with pytest.raises(ValueError, match=r"field 'a#0' ends in '#' and a number, .* of field 'a' are named"):
            storage.put(["0@a", "0@a#0"], [torch.ones(2), torch.zeros(2)])
        big = torch.arange(1_000_000, dtype=torch.int32)  # 4 MB: parts of half a message
        assert storage.put(["0@a"], [big]) == [{"expbuf_parts": 8}]
        assert torch.equal(storage.get(["0@a"])[0], big)
    finally:
        storage.close()


def test_keys_that_hold_tags_alone_are_cleared_with_their_partition(
    ray_cluster: ModuleType, start_server: Servers
) -> None:
    """Keys put with tags and no field (kv_batch_put(..., tags=...), as TransferQueue documents):
    a clear refused "nothing to clear", and the keys and their partition stayed for good."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    tq.init(OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": "tq"}}}))
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="meta", tags=[{"score": 1}, {"score": 2}])
        tq.kv_clear(keys=["a"], partition_id="meta")
        assert list(tq.kv_list(partition_id="meta")["meta"]) == ["b"]
        tq.get_client().clear_partition("meta")
        assert "meta" not in tq.get_client().get_partition_list()
    finally:
        tq.close()
