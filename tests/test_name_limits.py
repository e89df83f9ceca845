"""A call that the server's one writer works through whole names at most so many uids, group ids
or keys (client/schema/call_limits.py): more is refused by name before anything is read or
stored, and the server serves on; the clients send any number in calls of at most that many."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import AsyncBufferClient, BufferClient, InvalidArgumentError, Prompt, trxp
from expbuf.client.rpc.calls import group_calls, lease_calls, read_calls, table_calls, value_calls
from expbuf.client.schema.call_limits import MAX_KEYS_PER_CALL, MAX_NAMES_PER_CALL, MAX_READ_UIDS, MAX_REWARDS, in_parts
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import group_items, scrape


def answered(server: ExpbufServer, method: str) -> float:
    """Calls of `method` the server has answered, whatever their status."""
    return sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count" and dict(labels)["method"] == method
    )


def test_in_parts_cuts_in_order_and_makes_one_call_of_nothing() -> None:
    assert in_parts([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert in_parts([1, 2], 2) == [[1, 2]]
    assert in_parts([], 2) == [[]]


def test_a_call_naming_too_many_is_refused_and_stores_nothing(
    client: BufferClient, stub: pb_grpc.ExperienceBufferStub
) -> None:
    client.create_table("t", group_size=2, estimator="none")
    client.push(trxp.build(group_items(0, 0, 2)), table="t")
    names = [f"0/{i}/0/0/r0s0" for i in range(MAX_NAMES_PER_CALL + 1)]
    keys = [f"k{i}" for i in range(MAX_KEYS_PER_CALL + 1)]
    refused = (
        ("Delete", pb.DeleteRequest(table="t", uids=names), "uids", MAX_NAMES_PER_CALL),
        ("Delete", pb.DeleteRequest(table="t", group_ids=names), "group_ids", MAX_NAMES_PER_CALL),
        ("Retire", pb.RetireRequest(table="t", group_ids=names), "group_ids", MAX_NAMES_PER_CALL),
        ("FailRuns", pb.FailRunsRequest(table="t", uids=names), "uids", MAX_NAMES_PER_CALL),
        ("PutValues", pb.PutValuesRequest(table="t", keys=keys, values=[b"v"] * len(keys)), "keys", MAX_KEYS_PER_CALL),
        ("ClearValues", pb.ClearValuesRequest(table="t", keys=keys), "keys", MAX_KEYS_PER_CALL),
    )
    for method, request, what, most in refused:
        with pytest.raises(grpc.RpcError) as error:
            getattr(stub, method)(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert f"{what} names {most + 1}; a {method} names at most {most}" in error.value.details(), method
    # nothing was stored or removed, and the server serves on
    assert client.get_values(keys[:3], table="t") == [None, None, None]
    stats = client.stats("t")["t"]
    assert (stats.ready, stats.consumed, stats.groups_pending, stats.groups_dropped) == (2, 0, 0, 0)
    assert client.delete(["0/0/0/0/r0s0"], table="t") == 1


def test_the_clients_send_any_number_in_calls_of_the_most_each_takes(
    server: ExpbufServer, client: BufferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in (lease_calls, table_calls):  # retire's, delete's
        monkeypatch.setattr(module, "MAX_NAMES_PER_CALL", 3)
    monkeypatch.setattr(value_calls, "MAX_KEYS_PER_CALL", 4)
    client.create_table("t", group_size=1, group_by="run", estimator="none")
    client.push(trxp.build([item for task in range(8) for item in group_items(0, task, 1)]), table="t")
    uids = [f"0/{task}/0/0/r0s0" for task in range(8)]
    keys = [f"k{i}" for i in range(10)]

    before = {method: answered(server, method) for method in ("Delete", "Retire", "PutValues", "ClearValues")}
    assert client.put_values(keys, [key.encode() for key in keys], table="t") == 10  # 4 + 4 + 2
    assert client.get_values(keys, table="t") == [key.encode() for key in keys]
    assert client.clear_values([*keys, "absent"], table="t") == 10  # 4 + 4 + 3
    assert client.retire([f"0/{task}/0" for task in range(4)], table="t") == 4  # 3 + 1
    assert client.delete(uids[4:], table="t", groups=["0/0/0"]) == 4  # 3 + 1 uids, 1 group (retired: its tombstone)
    called = {method: answered(server, method) - count for method, count in before.items()}
    assert called == {"Delete": 2, "Retire": 2, "PutValues": 3, "ClearValues": 3}
    assert client.stats("t")["t"].live == 0

    async def from_asyncio() -> tuple[int, int]:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}", timeout=10) as aio:
            stored = await aio.put_values(keys, [b"x"] * 10, table="t")
            return stored, await aio.clear_values(keys, table="t")

    assert asyncio.run(from_asyncio()) == (10, 10)


def test_the_clients_read_any_number_in_calls_of_the_most_each_takes(
    server: ExpbufServer, client: BufferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get and read_fields name at most MAX_READ_UIDS uids a ReadFields and join the parts' results
    into what one read of them all gives: the same order, the same columns, the same missing uids;
    get_partials names at most as many task ids a call."""
    client.create_table("t", group_size=1, group_by="run", estimator="none")
    client.push(trxp.build([item for task in range(8) for item in group_items(0, task, 1)]), table="t")
    uids = [f"0/{task}/0/0/r0s0" for task in (5, 0, 7, 1, 6, 2, 4, 3)] + ["absent"]
    fields = ["tokens", "reward", "logprobs"]
    whole, one = client.read_fields(uids, fields, table="t"), client.get([*uids, uids[0]], table="t")
    monkeypatch.setattr(read_calls, "MAX_READ_UIDS", 3)
    before = answered(server, "ReadFields")
    parted = client.read_fields(uids, fields, table="t")  # 3 + 3 + 3
    assert answered(server, "ReadFields") - before == 3
    assert (parted.uids, parted.group_ids, parted.missing_uids) == (whole.uids, whole.group_ids, ["absent"])
    for name in fields:
        got, want = parted.columns[name], whole.columns[name]
        assert got.items == want.items and got.shapes == want.shapes, name
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors, strict=True)), name
    got = client.get([*uids, uids[0]], table="t")  # the duplicate read once, answered twice
    assert [exp.eid.uid for exp in got] == [exp.eid.uid for exp in one] == [*uids[:-1], uids[0]]
    assert got.missing_uids == one.missing_uids == ["absent"]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(got, one, strict=True))
    assert answered(server, "ReadFields") - before == 6

    partials = answered(server, "ReadPartials")
    assert client.get_partials([f"0/{task}" for task in range(8)], table="t") == []  # none held in pieces
    assert answered(server, "ReadPartials") - partials == 3  # 3 + 3 + 2 task ids

    async def from_asyncio() -> tuple[list[str], list[str]]:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}", timeout=10) as aio:
            read = await aio.read_fields(uids, ["tokens"], table="t")
            return read.uids, [exp.eid.uid for exp in await aio.get(uids, table="t")]

    assert asyncio.run(from_asyncio()) == (uids[:-1], uids[:-1])
    assert answered(server, "ReadFields") - before == 12

    before = answered(server, "ReadFields")
    with pytest.raises(ValueError, match="uid '0/5/0/0/r0s0' is named more than once"):
        client.read_fields([*uids[:5], uids[0]], ["tokens"], table="t")  # the copies in two calls
    assert answered(server, "ReadFields") == before  # refused before any call
    sliced = client.read_fields(uids, ["tokens"], table="t", share=iter([1, 0]), of=2)  # taken once for every call
    monkeypatch.undo()
    once = client.read_fields(uids, ["tokens"], table="t", share=(1, 0), of=2)
    assert sliced.uids == once.uids
    pairs = zip(sliced.columns["tokens"].tensors, once.columns["tokens"].tensors, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_failed_runs_reported_in_several_calls_come_back_as_one_report(
    client: BufferClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_calls, "MAX_NAMES_PER_CALL", 2)
    client.create_table("t", group_size=4, min_group_size=1, estimator="none")
    client.push(trxp.build(group_items(0, 0, 1)), table="t")  # run 0 of task 0; runs 1-3 fail
    failed = [f"0/0/{run}/0/r{run}s0" for run in (1, 2, 3)] + [f"0/1/{run}/0/r{run}s0" for run in range(4)]
    reasons = [f"why {i}" for i in range(len(failed))]
    report = client.fail_runs(failed, table="t", reasons=reasons)
    assert report.recorded == failed
    assert report.completed_groups == ["0/0"]  # short, with its one run
    assert report.dropped_groups == ["0/1"]  # every run failed
    with pytest.raises(ValueError, match="7 uids for 1 reasons"):
        client.fail_runs(failed, table="t", reasons=["one"])  # before any call, not after a part


def test_the_wire_contract_states_the_limits_the_server_keeps() -> None:
    proto = (Path(__file__).resolve().parent.parent / "proto/expbuf/v1/buffer.proto").read_text()
    for method, most in (
        ("Get", MAX_READ_UIDS),
        ("ReadFields", MAX_READ_UIDS),
        ("GetValues", MAX_KEYS_PER_CALL),
        ("ReportPrompts", MAX_REWARDS),
        ("Delete", MAX_NAMES_PER_CALL),
        ("Retire", MAX_NAMES_PER_CALL),
        ("FailRuns", MAX_NAMES_PER_CALL),
        ("PutValues", MAX_KEYS_PER_CALL),
        ("ClearValues", MAX_KEYS_PER_CALL),
    ):
        above = proto[: proto.index(f"  rpc {method}(")].splitlines()
        comment = list(itertools.takewhile(lambda line: line.startswith("  //"), reversed(above)))
        assert f"{most:,}" in " ".join(comment), method


def test_reads_that_name_what_they_read_name_each_once_and_within_bounds(start_server: Servers) -> None:
    """A Get or a GetValues names each uid or key once (twice, it was read and sent twice: a Get
    of 3.8 KB naming one experience 2,000 times grew the server 12 GB) and at most so many; a Get
    whose experiences pass one message is refused before its payload is made; a ListPrompts names
    each state at most once, a ReportPrompts at most MAX_REWARDS rewards a prompt."""
    server = start_server(max_message_bytes=1 << 20)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client, grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        client.create_table("t", group_size=1, group_by="run", estimator="none")
        pushed = [item for task in range(3) for item in group_items(0, task, 1, response=40_000)]  # 360 KB each
        for item in pushed:
            client.push(trxp.build([item]), table="t")
        uids = [item.uid for item in pushed]
        client.put_values(["a"], [b"x"], table="t")
        refused = (
            ("Get", pb.GetRequest(table="t", uids=[uids[0]] * 2), "INVALID_ARGUMENT", "is named more than once"),
            (
                "Get",
                pb.GetRequest(table="t", uids=[f"u{i}" for i in range(MAX_READ_UIDS + 1)]),
                "INVALID_ARGUMENT",
                f"uids names {MAX_READ_UIDS + 1}; a Get names at most {MAX_READ_UIDS}",
            ),
            ("Get", pb.GetRequest(table="t", uids=uids), "RESOURCE_EXHAUSTED", "more than one message"),
            ("GetValues", pb.GetValuesRequest(table="t", keys=["a", "a"]), "INVALID_ARGUMENT", "named more than once"),
            (
                "GetValues",
                pb.GetValuesRequest(table="t", keys=[f"k{i}" for i in range(MAX_KEYS_PER_CALL + 1)]),
                "INVALID_ARGUMENT",
                f"keys names {MAX_KEYS_PER_CALL + 1}",
            ),
            (
                "GetPartials",
                pb.GetPartialsRequest(table="t", task_ids=[f"0/{i}" for i in range(MAX_READ_UIDS + 1)]),
                "INVALID_ARGUMENT",
                f"task_ids names {MAX_READ_UIDS + 1}; a GetPartials names at most {MAX_READ_UIDS}",
            ),
            (
                "GetPartials",
                pb.GetPartialsRequest(table="t", uids=[f"u{i}" for i in range(MAX_READ_UIDS + 1)]),
                "INVALID_ARGUMENT",
                f"uids names {MAX_READ_UIDS + 1}; a GetPartials names at most {MAX_READ_UIDS}",
            ),
            (
                "ListPrompts",
                pb.ListPromptsRequest(table="t", dataset="d", states=["pending"] * 6),
                "INVALID_ARGUMENT",
                "states names 6; a ListPrompts names at most 5",
            ),
        )
        for method, request, code, named in refused:
            with pytest.raises(grpc.RpcError) as error:
                getattr(stub, method)(request, timeout=30)
            assert error.value.code().name == code, method
            assert named in error.value.details(), (method, error.value.details())
        with pytest.raises(grpc.RpcError) as error:
            list(stub.ReadFields(pb.ReadFieldsRequest(table="t", uids=[f"u{i}" for i in range(MAX_READ_UIDS + 1)])))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"uids names {MAX_READ_UIDS + 1}; a ReadFields names at most {MAX_READ_UIDS}" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:  # GetPartials' stream, read as ReadFields is
            list(stub.ReadPartials(pb.GetPartialsRequest(table="t", task_ids=["0/0"] * (MAX_READ_UIDS + 1))))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"task_ids names {MAX_READ_UIDS + 1}; a GetPartials names" in error.value.details()
        reply = stub.Get(pb.GetRequest(table="t", uids=uids[:2]), timeout=30)  # within a message, as ever
        assert [e.eid.uid for e in trxp.decode_reply(reply.payload)] == uids[:2]
        assert len(client.get(uids, table="t")) == 3  # the clients read with ReadFields, in parts
        with pytest.raises(InvalidArgumentError, match=f"a prompt's rewards names {MAX_REWARDS + 1}"):
            client.report_prompts([(Prompt("d", 0, 0, 0, "d/0", "0", 0.0, table="t"), [1.0] * (MAX_REWARDS + 1))])
