"""Per-token policy versions (issue 44): an experience's version segments are checked at the door,
stored in its record, delivered with it (TRXP info and a `version_segments` column), and a table's
`max_token_staleness` masks the tokens of policies too far behind the trainer out of the action mask
where a batch is delivered ("mask"), or makes their experience stale ("drop"). The reference of the
masking is written from prime-rl's description (each output token has the version of the last segment
whose output offset is at or before it, and a token more than max_off_policy_steps behind is masked),
token by token, not from expbuf's prefix rule."""

from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import EID, BufferClient, Experience, trxp
from expbuf.client.errors import FailedPreconditionError
from expbuf.client.trxp.codec.common import TrxpError
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.disk.records import ItemRecord
from expbuf.server.store.schema.errors import ConfigError
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import scrape, take

PROMPT, RESPONSE = 3, 8
TRAINER = 5
# Each run's segments (None: its model_version alone) and its pushed action mask (False: a tool's tokens).
RUNS: list[tuple[list[list[int]] | None, int | None, list[bool]]] = [
    ([[2, 0], [4, 3], [5, 6]], None, [True] * 8),  # 3 tokens of version 2: masked with a bound of 1
    ([[4, 0], [5, 5]], None, [True, True, False, False, True, True, True, True]),  # nothing masked
    ([[1, 0], [3, 1], [3, 2], [6, 7]], None, [True, False, True, True, True, True, True, True]),  # 7 masked
    (None, 3, [True] * 8),  # one version, 2 behind: all masked
    (None, 5, [True] * 8),  # current
    ([[0, 0], [1, 4]], 9, [True] * 8),  # segments win over model_version: all masked
]


def experience(
    task: int, run: int, segments: list[list[int]] | None, version: int | None, mask: list[bool]
) -> Experience:
    info: dict = {}
    if version is not None:
        info["model_version"] = version
    if segments is not None:
        info["version_segments"] = segments
    return Experience(
        eid=EID(batch=0, task=task, run=run, suffix=f"r{run}"),
        tokens=torch.arange(PROMPT + RESPONSE, dtype=torch.int32),
        prompt_length=PROMPT,
        logprobs=torch.full((RESPONSE,), -0.5),
        action_mask=torch.tensor(mask),
        reward=float(run % 3),
        info=info,
    )


def group(task: int = 0) -> list[Experience]:
    return [experience(task, run, segments, version, mask) for run, (segments, version, mask) in enumerate(RUNS)]


def prime_rl_mask(exp: Experience, trainer: int, max_off_policy_steps: int) -> torch.Tensor:
    """The action mask a trainer following prime-rl masks with: each output token i has the version
    of the last segment whose output_offset <= i (the experience's one version without segments), and
    is masked when trainer - version > max_off_policy_steps."""
    segments = exp.info.get("version_segments") or [[exp.info["model_version"], 0]]
    keep = []
    for i in range(RESPONSE):
        version = [v for v, offset in segments if offset <= i][-1]
        keep.append(bool(exp.action_mask[i]) and trainer - version <= max_off_policy_steps)
    return torch.tensor(keep)


def oldest(exp: Experience) -> int:
    segments = exp.info.get("version_segments")
    return segments[0][0] if segments else exp.info["model_version"]


def test_segments_come_back_as_pushed_in_trxp_and_as_a_column(client: BufferClient) -> None:
    client.create_table("seg", group_size=len(RUNS), estimator="none")
    pushed = {exp.eid.uid: exp for exp in group()}
    client.push(list(pushed.values()), table="seg")
    (batch,) = client.sample("seg", num_groups=1, delivery="replay", max_batches=1, timeout=10)
    for got in batch.experiences:
        want = pushed[got.eid.uid]
        assert got.version_segments == want.info.get("version_segments") and got.info == want.info
    fields = ["version_segments", "model_version"]
    (cols,) = client.sample("seg", num_groups=1, delivery="replay", max_batches=1, timeout=10, fields=fields)
    column = cols.columns["version_segments"]
    assert column.items == list(range(len(RUNS)))
    for uid, tensor in zip(cols.uids, column.tensors, strict=True):
        want = pushed[uid].info.get("version_segments") or [[pushed[uid].info["model_version"], 0]]
        assert tensor.dtype == torch.int64 and tensor.tolist() == want
    # An experience's own version (staleness, min_model_version) is its oldest token's.
    versions = cols.columns["model_version"].values.tolist()
    assert versions == [oldest(pushed[uid]) for uid in cols.uids]


@pytest.mark.parametrize(
    ("segments", "words"),
    [
        ([], "non-empty list"),
        ("2@0", "non-empty list"),
        ([[1, 0, 2]], r"\[0\] must be a \[version, offset\] pair"),
        ([[1, 0], [2]], r"\[1\] must be a \[version, offset\] pair"),
        ([[1.0, 0]], "version must be an int"),
        ([[-1, 0]], "version must be an int"),
        ([[1, 2]], "must start at offset 0"),
        ([[1, 0], [2, 4], [3, 4]], "offsets must increase"),
        ([[1, 0], [2, 8]], r"offset must be an int inside the response \(0 to 7\)"),
        ([[3, 0], [2, 4]], "versions must not decrease"),
        ([[1, 0], [True, 2]], "version must be an int"),
    ],
)
def test_malformed_segments_are_refused_by_name_and_nothing_is_stored(
    client: BufferClient, stub: pb_grpc.ExperienceBufferStub, segments: object, words: str
) -> None:
    """The client refuses them as it encodes; the server refuses a payload written without that check."""
    client.create_table("bad", estimator="none", exist_ok=True)
    good = experience(1, 0, [[1, 0]], None, [True] * RESPONSE)
    bad = experience(1, 1, None, None, [True] * RESPONSE)
    bad.info["version_segments"] = segments
    with pytest.raises(TrxpError, match=words):
        client.push([good, bad], table="bad")
    items = [trxp.from_experience(good), trxp.from_experience(experience(1, 1, None, None, [True] * RESPONSE))]
    items[1].meta["info"]["version_segments"] = segments
    with pytest.raises(grpc.RpcError) as refused:
        stub.Push(pb.PushRequest(table="bad", payload=trxp.build(items)), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(words, refused.value.details() or "") and "item 1" in (refused.value.details() or "")
    assert client.stats("bad")["bad"].pushed == 0
    assert client.push([good], table="bad").stored == [good.eid.uid]  # the server is healthy


def test_segments_on_an_experience_without_a_response_are_refused(client: BufferClient) -> None:
    client.create_table("empty", estimator="none")
    exp = Experience(eid=EID(batch=0, task=0, run=0), tokens=torch.arange(4), prompt_length=4)
    exp.info["version_segments"] = [[1, 0]]
    with pytest.raises(TrxpError, match="no response tokens"):
        client.push([exp], table="empty")


@pytest.mark.parametrize("fields", [None, ["action_mask", "advantages", "returns"]])
def test_stale_tokens_are_masked_as_prime_rl_masks_them_and_the_advantages_follow(
    start_server: Servers, fields: list[str] | None
) -> None:
    """The same groups in a table without the bound and one with max_token_staleness 1, the trainer
    at version 5: the delivered masks are the reference's, and each GRPO advantage is the unbounded
    table's times the delivered mask (the estimator ran on the pushed experience; only what is
    delivered is masked). ReadFields of the same experiences delivers the same masks."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("plain", group_size=len(RUNS))
        client.create_table("bounded", group_size=len(RUNS), max_token_staleness=1)
        pushed = {exp.eid.uid: exp for exp in group()}
        for table in ("plain", "bounded"):
            client.push(list(pushed.values()), table=table)
            client.set_trainer_version(TRAINER, table)
        got = {}
        for table in ("plain", "bounded"):
            (batch,) = client.sample(table, num_groups=1, delivery="lease", max_batches=1, timeout=10, fields=fields)
            if fields is None:
                got[table] = {e.eid.uid: (e.action_mask, e.advantages) for e in batch.experiences}
            else:
                masks, advs = (batch.columns[name].tensors for name in ("action_mask", "advantages"))
                got[table] = dict(zip(batch.uids, zip(masks, advs, strict=True), strict=True))
            if table == "bounded":
                read = client.read_fields(batch.uids, ["action_mask"], table=table)
                read_masks = dict(zip(read.uids, read.columns["action_mask"].tensors, strict=True))
            batch.ack()
        masked = 0
        for uid, exp in pushed.items():
            want = prime_rl_mask(exp, TRAINER, 1)
            mask, advantages = got["bounded"][uid]
            assert mask.tolist() == want.tolist(), uid
            assert read_masks[uid].tolist() == want.tolist(), uid
            plain_mask, plain_advantages = got["plain"][uid]
            assert plain_mask.tolist() == exp.action_mask.tolist()
            assert torch.equal(advantages, plain_advantages * want.float())
            masked += int(exp.action_mask.sum() - want.sum())
        assert masked == 3 + 6 + 8 + 8  # guards the reference itself: runs 0, 2, 3 and 5 lose tokens
        stats = client.stats("bounded")["bounded"]
    metrics = scrape(server.metrics_port)
    # The tokens behind the bound in the batch sampled (the pushed masks aside; a read is not counted).
    assert metrics[("expbuf_tokens_masked_total", (("table", "bounded"),))] == 3 + 7 + 8 + 8
    assert metrics[("expbuf_tokens_masked_total", (("table", "plain"),))] == 0
    assert stats.pushed == len(RUNS)


def test_get_returns_experiences_as_stored_and_read_fields_as_delivered(client: BufferClient, target: str) -> None:
    """get() (ReadFields without fields) and the Get call return the pushed action mask and the
    advantages the estimator computed, as the docs say; read_fields delivers the masked ones, as a
    sample does. get() returned the delivered (masked) mask."""
    client.create_table("plain", group_size=len(RUNS))
    client.create_table("bounded", group_size=len(RUNS), max_token_staleness=1)
    pushed = {exp.eid.uid: exp for exp in group()}
    for table in ("plain", "bounded"):
        client.push(list(pushed.values()), table=table)
        client.set_trainer_version(TRAINER, table)
        deadline = time.monotonic() + 60  # the advantages are computed in the push, or by the worker after it
        while client.stats(table)[table].ready < len(RUNS):
            assert time.monotonic() < deadline, f"{table}: the group is not ready"
            time.sleep(0.05)
    uids = list(pushed)
    plain = {exp.eid.uid: exp for exp in client.get(uids, "plain")}
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.ExperienceBufferStub(channel).Get(pb.GetRequest(table="bounded", uids=uids))
    for got in (client.get(uids, "bounded"), trxp.decode(reply.payload)):
        assert [exp.eid.uid for exp in got] == uids
        for exp in got:
            assert exp.action_mask.tolist() == pushed[exp.eid.uid].action_mask.tolist(), exp.eid.uid
            assert torch.equal(exp.advantages, plain[exp.eid.uid].advantages), exp.eid.uid
    read = client.read_fields(uids, ["action_mask"], table="bounded")
    for uid, mask in zip(read.uids, read.columns["action_mask"].tensors, strict=True):
        assert mask.tolist() == prime_rl_mask(pushed[uid], TRAINER, 1).tolist(), uid


def test_the_trxp_splice_without_compact_advantages_masks_too(tmp_path: Path) -> None:
    """The store's own sample builds the TRXP batch with its advantages spliced in (no compact values)."""
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        got = {}
        for table, bound in (("plain", None), ("t", 2)):
            store.create_table(TableConfig.of(table, group_size=len(RUNS), max_token_staleness=bound))
            store.put(table, [trxp.from_experience(exp) for exp in group()])
            store.set_trainer_version(table, TRAINER)
            assert AdvantageWorker(store).run_once() == 1
            batch = take(store, table, num_groups=1)
            assert batch is not None
            got[table] = {e.eid.uid: e for e in trxp.decode(batch.payload)}
            if bound is not None:  # a table without a token bound masks nothing, and keeps no counts
                masked = dict(zip(batch.uids, batch.masked, strict=True))
        assert [masked[exp.eid.uid] for exp in group()] == [3, 0, 1, 0, 0, 8]
        for exp in group():
            want = prime_rl_mask(exp, TRAINER, 2)
            one, plain = got["t"][exp.eid.uid], got["plain"][exp.eid.uid]
            assert one.action_mask.tolist() == want.tolist()
            assert torch.equal(one.advantages, plain.advantages * want.float())
            assert torch.equal(one.returns, plain.returns * want.float())
        assert store.stats("t")["tokens_masked"] == 3 + 1 + 8 and store.stats("plain")["tokens_masked"] == 0


def test_drop_makes_an_experience_with_a_stale_token_stale_at_push(client: BufferClient) -> None:
    client.create_table("drop", group_size=0, estimator="none", max_token_staleness=1, on_token_stale="drop")
    client.create_table("refuse", estimator="none", max_token_staleness=1, on_token_stale="drop", on_stale="refuse")
    for table in ("drop", "refuse"):
        client.set_trainer_version(TRAINER, table)
    exps = group()
    done = client.push(exps, table="drop")
    stale = {exps[run].eid.uid for run in (0, 2, 3, 5)}  # an oldest token more than 1 behind
    assert set(done.stale) == stale and set(done.stored) == {e.eid.uid for e in exps} - stale
    with pytest.raises(
        FailedPreconditionError,
        match=r"model_version 2 \(its oldest token's\), below 4 \(trainer version 5 - max_token_staleness 1\)",
    ):
        client.push(exps, table="refuse")
    assert client.stats("refuse")["refuse"].pushed == 0


def test_settings_are_checked_and_travel_the_wire(client: BufferClient) -> None:
    config = TableConfig.of("t", max_token_staleness=2, on_token_stale="drop", max_staleness=4)
    assert config.staleness.experience_bound == 2 and config.staleness.token_bound is None
    assert TableConfig.of("t", max_token_staleness=2).staleness.token_bound == 2
    with pytest.raises(ConfigError, match="max_token_staleness must be an integer"):
        TableConfig.of("t", max_token_staleness=-1)
    with pytest.raises(ConfigError, match="on_token_stale"):
        TableConfig.of("t", on_token_stale="hide")
    client.create_table("w", max_token_staleness=3, on_token_stale="drop")
    info = next(t for t in client.list_tables() if t.name == "w")
    assert (info.max_token_staleness, info.on_token_stale) == (3, "drop")


def test_records_keep_segments_and_a_record_of_the_release_before_reads_without() -> None:
    base = dict(state="ready", group="g", seq=1, digest=b"d" * 16, size=3, created=1.0, tid="0/0", rid="0/0/0")
    rec = ItemRecord(**base, step=0, response_length=8, generated=8, version=2, segments=(2, 0, 4, 3))
    assert ItemRecord.decode(rec.encode()) == rec
    before = ItemRecord(**base, step=0, response_length=8, generated=8, version=2)
    assert before.encode() == rec.encode()[: len(before.encode())]  # the segments are a tail
    assert ItemRecord.decode(before.encode()).segments == ()
