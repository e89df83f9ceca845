"""Pushes as columns (ColumnBatch): a rollout worker's tensors pushed field by field are stored
byte for byte as the same experiences pushed as Experience objects (the server answers the
second push of the two "duplicate", which it says only of identical bytes); every form of a
field gives the same payload; a bad batch is refused naming its fault, stores nothing and
leaves the server serving. A real server on loopback, real LMDB."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import BufferClient, BufferError, ColumnBatch, trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.client.trxp.column_batch import items as column_push
from expbuf.client.trxp.column_batch import wire as column_wire
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.rpc.push.ingest import Ingest, entries_of, metadata_limit
from expbuf.server.store.schema.errors import InvalidPayload

from conftest import Servers
from helpers import wait_ready
from pages import code_blocks, section


def rollout(task: int | str, run: int, *, half: bool = False, image: bool = False, long: int = 0) -> Experience:
    """A rollout with MoE routing ids (uint8, 2 experts a token), a policy version and, for some,
    an image and bfloat16 log-probs; `long` more tokens in its response."""
    number = task if isinstance(task, int) else len(task)
    prompt, response = 3 + number, 4 + number + run + long
    return Experience(
        eid=EID(batch=0, task=task, run=run, suffix=f"r{run}"),
        tokens=torch.arange(prompt + response, dtype=torch.int64) + 100 * run,
        prompt_length=prompt,
        logprobs=torch.linspace(-1, 0, response, dtype=torch.bfloat16 if half else torch.float32),
        action_mask=torch.arange(response) % 3 != 0,
        routed_experts=(torch.arange((prompt + response) * 2, dtype=torch.uint8) % 64).reshape(-1, 2),
        reward=float(run) / 2,
        # runs 1 and 2 carry a priority and the policy versions of their tokens, tasks 1 and 2 info of their own
        info={"model_version": 7 + run}
        | ({} if run == 0 else {"priority": run / 4, "version_segments": [[6 + run, 0], [7 + run, 2]]})
        | ({"turns": run, "env": "shop", "tags": {"split": "train", "ids": [1, 2.5, None]}} if number else {}),
        # two inputs in an order other than the store's (I64 before F16): each lists its keys as given
        multi_modal_inputs={
            "pixels": torch.ones(2, 3 + run, dtype=torch.float16),
            "grid": torch.tensor([1, 2, 3 + run]),
        }
        if image
        else {},
    )


OWN_COLUMNS = ("model_version", "priority", "version_segments")  # the info keys with a column of their own


def batch_of(made: list[Experience]) -> ColumnBatch:
    """The experiences as a ColumnBatch of lists, None where one lacks a field."""
    fields = {
        name: [getattr(exp, name) for exp in made] for name in ("tokens", "logprobs", "action_mask", "routed_experts")
    }
    for key in ("pixels", "grid"):
        if any(exp.multi_modal_inputs for exp in made):
            fields[f"multi_modal_inputs:{key}"] = [exp.multi_modal_inputs.get(key) for exp in made]
    return ColumnBatch(
        [exp.eid for exp in made],
        fields,
        reward=[exp.reward for exp in made],
        prompt_length=[exp.prompt_length for exp in made],
        model_version=[exp.info["model_version"] for exp in made],
        priority=[exp.info.get("priority") for exp in made],
        version_segments=[exp.info.get("version_segments") for exp in made],
        info=[{key: exp.info[key] for key in exp.info if key not in OWN_COLUMNS} or None for exp in made],
    )


def groups() -> list[Experience]:
    return [rollout(task, run, half=run == 1, image=task == 1 and run != 2) for task in range(3) for run in range(3)]


def test_a_column_push_stores_the_bytes_of_the_same_experiences_pushed_whole(client: BufferClient) -> None:
    made = groups()
    client.create_table("whole", group_size=3, estimator="grpo")
    first = client.push(made, table="whole")
    assert first.stored == [exp.eid.uid for exp in made] and len(first.completed_groups) == 3
    again = client.push(batch_of(made), table="whole")
    assert again.duplicates == first.stored and not again.stored  # identical bytes, or it would be refused
    client.create_table("columns", group_size=3, estimator="grpo")
    pushed = client.push(batch_of(made), table="columns")
    assert pushed.stored == first.stored and pushed.completed_groups == first.completed_groups
    for table in ("whole", "columns"):  # with their advantages, which the worker computes on CUDA
        wait_ready(client, table, len(made))
    for whole, columns in zip(client.get(first.stored, "whole"), client.get(first.stored, "columns"), strict=True):
        assert whole.eid == columns.eid and whole.info == columns.info and whole.reward == columns.reward
        for name in ("tokens", "logprobs", "action_mask", "routed_experts", "advantages"):
            assert torch.equal(getattr(whole, name), getattr(columns, name)), name
        assert list(whole.multi_modal_inputs) == list(columns.multi_modal_inputs)


def test_every_form_of_a_field_gives_the_same_payload() -> None:
    made = [rollout(2, run) for run in range(3)]
    eids = [exp.eid for exp in made]
    tokens = [exp.tokens for exp in made]
    lengths = torch.tensor([len(t) for t in tokens])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    nested = torch.nested.nested_tensor(tokens, layout=torch.jagged)
    rewards = [exp.reward for exp in made]
    forms = [tokens, nested, (torch.cat(tokens), offsets)]
    payloads = {
        ColumnBatch(eids, {"tokens": form}, reward=torch.tensor(rewards)).payload
        for form in [*forms, (torch.cat(tokens), offsets)]
    }
    assert len(payloads) == 1
    # A dense tensor: each experience its row.
    dense = [exp.tokens[:9] for exp in made]
    assert ColumnBatch(eids, {"tokens": torch.stack(dense)}).payload == ColumnBatch(eids, {"tokens": dense}).payload
    items = list(column_wire.read(payloads.pop()).items())
    assert [item.uid for item in items] == [eid.uid for eid in eids]
    assert [item.meta["reward"] for item in items] == rewards


def test_offsets_as_a_list_and_nested_tensors_of_any_layout_give_the_rows_they_hold() -> None:
    eids = [EID(task=0, run=run, suffix="s") for run in range(2)]
    rows = [torch.arange(2), torch.arange(6, 12)]
    want = ColumnBatch(eids, {"tokens": rows}).payload
    assert ColumnBatch(eids, {"tokens": (torch.cat(rows), [0, 2, 8])}).payload == want
    holes = torch.nested.narrow(torch.arange(12).reshape(2, 6), 1, torch.tensor([0, 0]), torch.tensor([2, 6]),
                                layout=torch.jagged)  # fmt: skip
    assert ColumnBatch(eids, {"tokens": holes}).payload == want
    assert ColumnBatch(eids, {"tokens": torch.nested.nested_tensor(rows)}).payload == want  # strided layout
    grid = [torch.arange(8).reshape(2, 4), torch.arange(12).reshape(3, 4)]
    transposed = torch.nested.nested_tensor([g.T for g in grid], layout=torch.jagged)  # ragged in dim 2
    assert (
        ColumnBatch(eids, {"routed_experts": transposed}).payload
        == ColumnBatch(eids, {"routed_experts": [g.T.contiguous() for g in grid]}).payload
    )


def test_str_and_int_tasks_keep_their_type(client: BufferClient) -> None:
    client.create_table("kinds", group_by="none", estimator="none")
    named = [rollout("math", 0), rollout("code", 1)]
    client.push(batch_of(named), table="kinds")
    got = client.get([exp.eid.uid for exp in named], "kinds")
    assert [exp.eid.task for exp in got] == ["math", "code"]
    with pytest.raises(trxp.TrxpError, match=r"eid\.task is an int for some experiences and a str for others"):
        batch_of([rollout("math", 0), rollout(1, 0)])


def test_a_pusher_and_a_push_in_chunks_take_columns(target: str) -> None:
    made = [rollout(task, run, long=4_000) for task in range(3) for run in range(3)]  # 3 x 60 KiB a push
    with BufferClient(target, timeout=10, push_chunk_bytes=1 << 16) as client:
        client.create_table("chunks", group_size=3)
        assert client.push(batch_of(made[:3]), table="chunks").stored == [exp.eid.uid for exp in made[:3]]
        with client.pusher("chunks", window=2) as pusher:
            futures = [pusher.push(batch_of(made[3:6])), pusher.push(batch_of(made[6:]))]
        assert [uid for future in futures for uid in future.result().stored] == [exp.eid.uid for exp in made[3:]]
        assert client.stats("chunks")["chunks"].pushed == len(made)


def test_a_sharded_client_sends_each_shard_its_groups_as_columns(start_server: Servers, tmp_path: Path) -> None:
    targets = {name: f"127.0.0.1:{start_server(data=tmp_path / name, shard=name).port}" for name in ("s0", "s1")}
    made = [rollout(task, run) for task in range(8) for run in range(2)]
    with ShardedBufferClient(targets, timeout=10) as client:
        client.create_table("spread", group_size=2)
        result = client.push(batch_of(made), table="spread")
        assert sorted(result.stored) == sorted(exp.eid.uid for exp in made)
        per_shard = client.shard_stats("spread")
        assert all(stats["spread"].pushed for stats in per_shard.values())  # both shards got some
        got = {exp.eid.uid: exp for exp in client.get([exp.eid.uid for exp in made], "spread")}
    for exp in made:
        assert torch.equal(got[exp.eid.uid].routed_experts, exp.routed_experts)


def raw(message: pb.ColumnBatch, values: list[bytes]) -> bytes:
    return b"".join(column_wire.write(message, values))


def good() -> tuple[pb.ColumnBatch, list[bytes]]:
    """Two experiences of 5 tokens (prompt 2), their log-probs and rewards, as the wire has them."""
    message = pb.ColumnBatch(batches=["0", "0"], tasks=["t", "t"], runs=[0, 1], steps=[0, 0], suffixes=["a", "b"])
    message.columns.add(name="tokens", dtype="I64", items=[0, 1], ndim=1, shapes=[5, 5])
    message.columns.add(name="logprobs", dtype="F32", items=[0, 1], ndim=1, shapes=[3, 3])
    message.columns.add(name="prompt_length", dtype="I64", items=[0, 1], ndim=0)
    message.columns.add(name="reward", dtype="F64", items=[0, 1], ndim=0)
    values = [
        torch.arange(10).numpy().tobytes(),
        torch.zeros(6).numpy().tobytes(),
        torch.tensor([2, 2]).numpy().tobytes(),
        torch.tensor([0.0, 1.0], dtype=torch.float64).numpy().tobytes(),
    ]
    return message, values


def _break(fault: str) -> bytes:
    message, values = good()
    tokens, logprobs = message.columns[0], message.columns[1]
    if fault == "items out of order":
        tokens.items[:] = [1, 0]
    elif fault == "an item past the batch":
        tokens.items[:] = [0, 2]
    elif fault == "shapes for another ndim":
        tokens.shapes.append(1)
    elif fault == "values short":
        values[1] = values[1][:-4]
    elif fault == "values left over":
        values.append(b"\0" * 8)
    elif fault == "an unknown field":
        logprobs.name = "logits"
    elif fault == "an unknown dtype":
        logprobs.dtype = "F128"
    elif fault == "a reward as F32":
        message.columns[3].dtype = "F32"
    elif fault == "segments of three numbers":
        message.columns.add(name="version_segments", dtype="I64", items=[1], ndim=2, shapes=[1, 3])
        values.append(b"\0" * 24)
    elif fault == "segments that go back":
        message.columns.add(name="version_segments", dtype="I64", items=[1], ndim=2, shapes=[2, 2])
        values.append(torch.tensor([5, 0, 4, 1]).numpy().tobytes())
    elif fault == "a reward twice":
        message.columns.add(name="reward", dtype="F64", items=[0], ndim=0)
        values.append(b"\0" * 8)
    elif fault == "a field twice for one experience":
        message.columns.add(name="logprobs", dtype="BF16", items=[1], ndim=1, shapes=[3])
        values.append(b"\0" * 6)
    elif fault == "eids of another length":
        message.runs.append(2)
    elif fault == "an int batch that is not one":
        message.int_batches = True
        message.batches[1] = "0x1"
    elif fault == "log-probs longer than the response":
        logprobs.shapes[:] = [4, 3]
        values[1] += b"\0" * 4
    elif fault == "no tokens":
        message.columns[0].items[:] = [0]
        message.columns[0].shapes[:] = [5]
        values[0] = values[0][:40]
    elif fault == "a task with a slash":
        message.tasks[1] = "a/b"
    elif fault == "values inside the message":
        logprobs.values = values.pop(1)
    elif fault == "a shape past 2**63 behind a zero":
        message.columns.add(name="routed_experts", dtype="U8", items=[0], ndim=2, shapes=[0, 2**64 - 1])
    elif fault in INFOS:
        message.columns.add(name="info", dtype="U8", items=[1], ndim=1, shapes=[len(INFOS[fault])])
        values.append(INFOS[fault])
        if fault == "info giving model_version twice":
            message.columns.add(name="model_version", dtype="I64", items=[0, 1], ndim=0)
            values.append(torch.tensor([1, 2]).numpy().tobytes())
    elif fault == "a message that is not one":
        return column_wire.HEAD.pack(column_wire.MAGIC, 3) + b"\xff\xff\xff"
    return raw(message, values)


INFOS = {
    "info that is not JSON": b"{bad",
    "info that is a list": b"[1]",
    "info nested too deep": b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "info giving model_version twice": b'{"model_version":3}',
}
FAULTS = {
    "info that is not JSON": "column 'info': experience 1's info is not a JSON object in UTF-8",
    "info that is a list": "column 'info': experience 1's info is a JSON list, not an object",
    "info nested too deep": "column 'info': experience 1's info is not a JSON object in UTF-8",
    "info giving model_version twice": "experience 1's info gives 'model_version' twice",
    "items out of order": "items must be increasing positions in the batch of 2, got 0 after 1",
    "an item past the batch": "items must be increasing positions in the batch of 2, got 2 after 0",
    "shapes for another ndim": "column 'tokens' has 3 shape numbers for 2 experiences of ndim 1",
    "values short": "the columns' shapes need 136 bytes of values; 132 are there",
    "values left over": "8 bytes after the columns' values belong to no column",
    "an unknown field": "column 'logits' names no field of an experience",
    "an unknown dtype": "column 'logprobs' has unsupported dtype 'F128'",
    "a reward as F32": "column 'reward' holds one F64 value an experience (ndim 0), got 'F32'",
    "a reward twice": "has a metadata column twice",
    "segments of three numbers": "experience 1's shape [1, 3] is not [pairs, 2]",
    "segments that go back": "info.version_segments[1]: versions must not decrease, got 4 after 5",
    "a field twice for one experience": "experience 1 has the field in two columns",
    "eids of another length": "the column batch has 3 runs for 2 suffixes",
    "an int batch that is not one": "field 'eid.batch' is marked an int, but '0x1' is not one in decimal",
    "log-probs longer than the response": "field 'logprobs' has length 4, but the response has 3 tokens",
    "no tokens": "field 'tokens' is missing",
    "a task with a slash": "field 'eid.task' contains '/'",
    "values inside the message": "column 'logprobs' carries values in the message",
    "a message that is not one": "the column batch's message is not a ColumnBatch",
    "a shape past 2**63 behind a zero": "experience 0's shape [0, 18446744073709551615] has more elements than a",
}


def test_a_bad_column_batch_is_refused_by_name_stores_nothing_and_the_server_serves_on(client: BufferClient) -> None:
    client.create_table("bad", group_by="none", estimator="none")
    for fault, named in FAULTS.items():
        with pytest.raises(BufferError) as info:
            client.push(_break(fault), table="bad")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, fault
        assert named in info.value.details, (fault, info.value.details)
    assert client.stats("bad")["bad"].pushed == 0
    message, values = good()
    assert client.push(raw(message, values), table="bad").stored == ["0/t/0/0/a", "0/t/1/0/b"]


def tiny(count: int, tokens: int = 1) -> bytes:
    """A batch of `count` experiences of `tokens` one-byte tokens each, empty eids, prompts of 0."""
    message = pb.ColumnBatch(batches=[""] * count, tasks=[""] * count, runs=[0] * count, steps=[0] * count)
    message.suffixes.extend([""] * count)
    message.columns.add(name="tokens", dtype="U8", items=range(count), ndim=1, shapes=[tokens] * count)
    message.columns.add(name="prompt_length", dtype="I64", items=range(count), ndim=0)
    return raw(message, [b"\1" * (count * tokens), b"\0" * (8 * count)])


def refused_holding_less_than_it(body: bytes) -> None:
    """`body` is refused by the expansion bound before its message is read, held memory less than it."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidPayload, match="names more experiences, columns or keys than a payload of"):
            entries_of(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body), (peak, len(body))


def test_a_batch_of_many_tiny_experiences_is_refused_before_it_is_held() -> None:
    """13 bytes an experience on the wire would expand to about 1.5 KB each in objects: refused by
    the expansion bound from its counts alone, nothing made."""
    refused_holding_less_than_it(tiny(200_000))
    # Just inside the bound, each is made, checked and packed as the one before is let go.
    body = tiny(2_000, tokens=40)
    assert len(entries_of(body)) == 2_000


def infos(*texts: bytes) -> bytes:
    """A batch of experiences of 4 tokens, one `info` (JSON) each."""
    count = len(texts)
    message = pb.ColumnBatch(batches=["0"] * count, tasks=["0"] * count, runs=range(count), steps=[0] * count)
    message.suffixes.extend(["s"] * count)
    message.int_batches = message.int_tasks = True
    message.columns.add(name="tokens", dtype="U8", items=range(count), ndim=1, shapes=[4] * count)
    message.columns.add(name="info", dtype="U8", items=range(count), ndim=1, shapes=[len(text) for text in texts])
    return raw(message, [b"\1\2\3\4" * count, b"".join(texts)])


@pytest.mark.parametrize("at", [0, 2, 5])
def test_every_experience_of_a_batch_has_its_metadata_checked_whatever_came_before(at: int) -> None:
    """The metadata of each experience made from columns is measured whole (its depth, its bytes
    written out): each is made, checked and let go in turn, and the next one's containers, at the
    addresses the last one's held, are not taken for those already measured (an info nested 40
    deep as a batch's third experience was stored, and then broke every read of it)."""
    small = b'{"x":{"y":1}}'
    deep = b'{"a":' + b"[" * 40 + b"]" * 40 + b"}"
    big = b'{"a":{"b":"' + b"x" * 300_000 + b'"}}'
    with pytest.raises(InvalidPayload, match=f"item {at} .*: field 'info': nested deeper than 32 levels"):
        entries_of(infos(*[small] * at, deep, small))
    with pytest.raises(InvalidPayload, match=f"item {at} .*more than max_metadata_bytes"):
        entries_of(infos(*[small] * at, big, small), metadata_limit(256 << 10))
    assert len(entries_of(infos(*[small] * (at + 2)), metadata_limit(256 << 10))) == at + 2


@pytest.mark.parametrize(("entry", "framed"), [("columns", b"\x42\x00"), ("keys", b"\x4a\x01k")])
def test_a_batch_naming_many_columns_or_keys_is_refused_before_they_are_read(entry: str, framed: bytes) -> None:
    """An empty column is two bytes on the wire and about a KiB once protobuf and the server have
    read it (a push of 5 million took 4.2 GB): a batch naming more than its payload may expand to
    is refused before its message is parsed, holding no more than the payload."""
    message, values = good()
    written = message.SerializeToString() + framed * 400_000
    refused_holding_less_than_it(column_push.HEAD.pack(column_push.MAGIC, len(written)) + written + b"".join(values))


def test_the_builder_refuses_what_it_cannot_lay_out() -> None:
    eids = [EID(task=0, run=run, suffix="s") for run in range(2)]
    with pytest.raises(trxp.TrxpError, match="a tuple is \\(values, offsets\\)"):
        ColumnBatch(eids, {"tokens": (torch.arange(3), torch.arange(3), torch.arange(3))})
    with pytest.raises(trxp.TrxpError, match="offsets must be a 1-D sequence of ints"):
        ColumnBatch(eids, {"tokens": (torch.arange(6), [0.0, 3.0, 6.0])})
    with pytest.raises(trxp.TrxpError, match=r"eid\.batch must be an int or a str, got bool"):
        ColumnBatch([EID(batch=True, suffix="s")], {"tokens": [torch.arange(3)]})
    # the parts named in the order of a uid, as the codec's check names them
    with pytest.raises(trxp.TrxpError, match=r"unknown keys \['rank'\] \(it holds batch, task, run, step, suffix\)"):
        ColumnBatch([{"task": 1, "rank": 0}], {"tokens": [torch.arange(3)]})
    with pytest.raises(trxp.TrxpError, match="field 'tokens': 3 values for 2 experiences"):
        ColumnBatch(eids, {"tokens": [torch.arange(3)] * 3})
    with pytest.raises(trxp.TrxpError, match="offsets must run from 0 to the 6 rows"):
        ColumnBatch(eids, {"tokens": (torch.arange(6), torch.tensor([0, 2, 5]))})
    with pytest.raises(trxp.TrxpError, match="'prompt_length' must hold ints or None"):
        ColumnBatch(eids, {"tokens": [torch.arange(3)] * 2}, prompt_length=[1, 1.5])
    with pytest.raises(trxp.TrxpError, match="differ in their number of dimensions"):
        ColumnBatch(eids, {"routed_experts": [torch.zeros(2, 2), torch.zeros(4)]})


def test_an_ingest_worker_reads_columns_as_this_process_does() -> None:
    pool = Ingest(1)
    pool.start()
    try:
        body = batch_of(groups()).payload
        assert pool._in_worker(body) == entries_of(body)
        with pytest.raises(Exception, match="items must be increasing") as there:
            pool._in_worker(_break("items out of order"))
        with pytest.raises(type(there.value)):
            entries_of(_break("items out of order"))
    finally:
        pool.close()


def docs_scope(made: list[Experience], tasks: int, runs: int) -> dict[str, object]:
    """What the docs' "Pushing columns" block names before it pushes: `made`'s fields as columns."""
    logprobs = [exp.logprobs for exp in made]
    return {
        "step": made[0].eid.batch,
        "tasks": tasks,
        "runs": runs,
        "tokens": torch.nested.nested_tensor([exp.tokens for exp in made], layout=torch.jagged),
        "logprob_values": torch.cat(logprobs),
        "logprob_offsets": torch.tensor([0, *torch.tensor([len(lp) for lp in logprobs]).cumsum(0).tolist()]),
        "masks": [exp.action_mask for exp in made],
        "routed": [exp.routed_experts for exp in made],
        "rewards": torch.tensor([exp.reward for exp in made]),
        "prompt_lengths": [exp.prompt_length for exp in made],
        "policy_version": 7,
    }


def test_the_docs_rollout_worker_pushes_its_columns_as_written(client: BufferClient) -> None:
    """docs/concepts/pushing-and-sampling.md, "Pushing columns": its push, as written there."""
    (code,) = code_blocks(section("concepts/pushing-and-sampling.md", "### Pushing columns"), "python")
    made = [rollout(task, run) for task in range(2) for run in range(3)]
    scope = {"client": client, **docs_scope(made, 2, 3)}
    exec(code, scope)
    result = scope["result"]
    assert len(result.stored) == 6 and len(result.completed_groups) == 2
    for exp, got in zip(made, client.get(result.stored, "columns"), strict=True):
        assert (got.eid.task, got.eid.run, got.reward, got.info) == (
            exp.eid.task,
            exp.eid.run,
            exp.reward,
            {"model_version": 7},
        )
        for name in ("tokens", "logprobs", "action_mask", "routed_experts"):
            assert torch.equal(getattr(got, name), getattr(exp, name)), name
