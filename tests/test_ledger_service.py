"""The prompt ledger over gRPC: the clients' create_dataset, claim, renew_claims,
release_claims, ledger and list_prompts against a real server on loopback, the refusals
they name, and a prompt's life from claim to trained through pushes and samples."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import lmdb
import pytest

from expbuf.client import (
    AlreadyExistsError,
    AsyncBufferClient,
    BufferClient,
    BufferError,
    Experience,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    Prompt,
    ResourceExhaustedError,
)
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL as MAX
from expbuf.client.schema.reasons import Reason
from expbuf.client.shards.aio import AsyncShardedBufferClient
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Store
from expbuf.server.store.ledger.records import DatasetRecord, PromptRecord, prompt_key
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import make_experience


def group(prompt: Prompt, runs: range, **kwargs: object) -> list[Experience]:
    """The experiences of one attempt at a prompt (rewards 0, 1, ...: never all equal)."""
    out = []
    for run in runs:
        exp = make_experience(0, 0, run, reward=float(run), **kwargs)
        exp.eid = prompt.eid(run)
        out.append(exp)
    return out


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server()


@pytest.fixture
def client(server: ExpbufServer) -> Iterator[BufferClient]:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("t", group_size=2, estimator="grpo")
        yield c


def test_a_prompts_life_from_claim_to_trained(client: BufferClient) -> None:
    info = client.create_dataset("t", "math", 3, epochs=2, seed=9, max_in_flight=4)
    assert (info.name, info.size, info.epochs, info.seed, info.owned, info.done) == ("math", 3, 2, 9, 6, False)
    assert ([c.pending for c in info.counts], info.total("pending")) == ([3], 6)  # epoch 1 has not started
    assert (
        client.create_dataset("t", "math", 3, epochs=2, seed=9, max_in_flight=4, exist_ok=True).created == info.created
    )
    with pytest.raises(AlreadyExistsError, match="epochs: the dataset has 2, the request 1"):
        client.create_dataset("t", "math", 3, seed=9, max_in_flight=4, exist_ok=True)
    claim = client.claim("t", "math", 2, lease_seconds=60, owner="worker-7")
    assert len(claim.prompts) == 2 and not claim.done
    first = claim.prompts[0]
    assert (first.batch, first.task, first.attempt) == ("math/0", f"{first.index}@0", 0)
    assert first.eid(3).uid == f"math/0/{first.index}@0/3/0/"
    assert first.expires > time.time() + 50
    client.push(group(first, range(2)), table="t")
    for _ in range(200):  # the group's advantages are computed, then it is sampled
        ledger = client.ledger("t", "math")
        if ledger.total("generated"):
            break
        time.sleep(0.02)
    assert (ledger.total("claimed"), ledger.total("generated")) == (1, 1)
    batch = next(client.sample("t", num_groups=1, timeout=10))
    assert batch.groups == [first.group]
    batch.ack()
    ledger = client.ledger("t", "math")
    assert (ledger.total("trained"), ledger.counts[0].pending, ledger.total("pending")) == (1, 1, 4)
    page = client.list_prompts("t", "math")
    assert [(p.index, p.state, p.owner) for p in page.prompts] == sorted(
        [(first.index, "trained", "worker-7"), (claim.prompts[1].index, "claimed", "worker-7")]
    )
    assert page.done and [p.state for p in client.list_prompts("t", "math", states=["trained"]).prompts] == ["trained"]
    assert client.datasets("t") == [client.ledger("t", "math")]


def test_a_report_made_again_counts_what_the_first_took(client: BufferClient) -> None:
    """A ReportPrompts whose reply was lost is made again (gRPC's retry, or its caller): it found the
    prompts trained and said 0, so a caller took their claims for ended and handed them out again."""
    client.create_dataset("t", "again", 4)
    claim = client.claim("t", "again", 4, lease_seconds=60)
    outcomes = {prompt: [1.0] for prompt in claim.prompts}
    assert client.report_prompts(outcomes) == 4
    assert client.report_prompts(outcomes) == 4
    assert client.ledger("t", "again").total("trained") == 4


def test_a_report_naming_a_prompt_twice_counts_it_once(server: ExpbufServer, client: BufferClient) -> None:
    """A ReportPrompts naming one prompt twice (a raw gRPC caller's) trained it once but answered
    reported = 2: its second mention found the prompt trained, as a report made again does, and
    counted it again (a helper's audit). A prompt counts once a call, as ReleaseClaims counts it."""
    client.create_dataset("t", "twice", 2)
    (prompt,) = client.claim("t", "twice", 1, lease_seconds=60).prompts
    ref = pb.PromptRef(epoch=prompt.epoch, index=prompt.index, attempt=prompt.attempt)
    outcome = pb.PromptOutcome(prompt=ref, rewards=[1.0])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        reply = stub.ReportPrompts(pb.ReportPromptsRequest(table="t", dataset="twice", outcomes=[outcome] * 2))
    assert reply.reported == 1
    assert client.ledger("t", "twice").total("trained") == 1


def test_a_push_into_an_ended_attempt_is_refused_naming_it(client: BufferClient) -> None:
    client.create_dataset("t", "math", 2)
    (prompt,) = client.claim("t", "math", lease_seconds=60).prompts
    client.push(group(prompt, range(1)), table="t")
    assert client.release_claims([prompt]) == 1
    with pytest.raises(FailedPreconditionError, match=r"attempt 0 of prompt math/0/0, whose claim ended"):
        client.push(group(prompt, range(1, 2)), table="t")
    (again,) = client.claim("t", "math", lease_seconds=60).prompts
    assert (again.index, again.attempt, again.task) == (0, 1, "0@1")
    assert client.renew_claims([again, prompt], 120) == [prompt]  # the ended one comes back


def test_claim_refusals_name_the_problem(client: BufferClient) -> None:
    with pytest.raises(NotFoundError, match="no dataset 'nope'"):
        client.claim("t", "nope")
    client.create_dataset("t", "math", 2)
    with pytest.raises(InvalidArgumentError, match="lease_seconds"):
        client.claim("t", "math", lease_seconds=0)
    with pytest.raises(InvalidArgumentError, match="count is 100000"):
        client.claim("t", "math", 100000)
    with pytest.raises(InvalidArgumentError, match="size is 0"):
        client.create_dataset("t", "empty", 0)
    client.create_table("runs", group_by="run")
    with pytest.raises(InvalidArgumentError, match="group_by = task"):
        client.create_dataset("runs", "math", 2)
    with pytest.raises(ValueError, match="unknown setting"):
        client.create_dataset("t", "typo", 2, epoch=3)


def test_a_claim_waits_for_a_prompt_to_come_back(client: BufferClient) -> None:
    client.create_dataset("t", "math", 1)
    assert len(client.claim("t", "math", lease_seconds=1).prompts) == 1
    started = time.monotonic()
    claim = client.claim("t", "math", wait=30)  # the first claim ends after 1 s: its prompt comes back
    assert [(p.index, p.attempt) for p in claim.prompts] == [(0, 1)]
    assert time.monotonic() - started < 29
    client.push(group(claim.prompts[0], range(2)), table="t")
    for _batch in client.sample("t", num_groups=1, timeout=10, delivery="consume", max_batches=1):
        pass
    assert client.claim("t", "math", wait=5).done


def test_a_claim_that_waits_commits_nothing_while_nothing_comes(client: BufferClient, server: ExpbufServer) -> None:
    """A claim with nothing to hand out sleeps until a change or its wait's end: each pass wrote the
    dataset again, its commit counted as a change, and the claim woke itself at once (some 1,300
    commits a second for its whole wait, every waiting Sample on the server woken by each)."""
    client.create_dataset("t", "math", 1)
    assert len(client.claim("t", "math", lease_seconds=60).prompts) == 1
    before = server.store.environment.batches
    started = time.monotonic()
    assert client.claim("t", "math", wait=1).prompts == []
    assert time.monotonic() - started >= 0.9
    assert server.store.environment.batches - before < 20, server.store.environment.batches - before


def test_a_listed_prompt_is_the_claimed_one_and_can_be_reported(client: BufferClient) -> None:
    """list_prompts gives each prompt with its stats; such a prompt is equal to the one claimed (same
    dataset, epoch, index and attempt, whatever its state, owner, end or stats), and can be reported:
    its stats made it unhashable, and report_prompts raised TypeError."""
    client.create_dataset("t", "math", 1)
    (claimed,) = client.claim("t", "math", lease_seconds=60).prompts
    (listed,) = client.list_prompts("t", "math").prompts
    assert listed.stats is not None and listed == claimed and hash(listed) == hash(claimed)
    assert client.report_prompts({listed: [1.0]}) == 1


def test_claims_are_bound_to_the_token_that_took_them(start_server: Servers) -> None:
    server = start_server(tokens={"a": frozenset({"push", "sample", "admin"}), "b": frozenset({"push", "sample"})})
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="a") as a, BufferClient(target, token="b") as b:
        a.create_table("t", group_size=2)
        a.create_dataset("t", "math", 2)
        (prompt,) = a.claim("t", "math").prompts
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            b.renew_claims([prompt], 60)
        with pytest.raises(PermissionDeniedError):
            b.create_dataset("t", "other", 2)  # admin scope
        a.push([Experience(eid=prompt.eid(0), tokens=list(range(4)), prompt_length=2, reward=1.0)], table="t")
        with pytest.raises(PermissionDeniedError, match="claimed with another token") as sealed:
            b.seal(prompt.eid(0).tid, table="t")  # the group of a's claim: only a completes it
        with pytest.raises(PermissionDeniedError, match="claimed with another token") as failed:
            b.fail_runs([prompt.eid(1).uid], table="t")
        # each refusal names its own call, not a push
        assert "this Seal call changes nothing" in str(sealed.value) and "push" not in str(sealed.value)
        assert "this FailRuns call changes nothing" in str(failed.value) and "push" not in str(failed.value)
        assert a.stats("t")["t"].groups_pending == 1
        assert a.seal(prompt.eid(0).tid, table="t") == 1


def test_the_async_client_claims_too(server: ExpbufServer, client: BufferClient) -> None:
    client.create_dataset("t", "math", 4)

    async def run() -> list[tuple[int, int]]:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}") as aclient:
            claim = await aclient.claim("t", "math", 4)
            assert await aclient.renew_claims(claim.prompts, 60) == []
            assert await aclient.release_claims(claim.prompts[2:]) == 2
            info = await aclient.ledger("t", "math")
            assert info.total("claimed") == 2 and len(await aclient.datasets("t")) == 1
            page = await aclient.list_prompts("t", "math", limit=2)
            assert len(page.prompts) == 2 and not page.done
            rest = await aclient.list_prompts("t", "math", after=page.after)
            assert len(rest.prompts) == 2 and rest.done
            return [(p.index, p.attempt) for p in claim.prompts]

    assert asyncio.run(run()) == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_paging_by_state_moves_past_pages_that_keep_no_prompt(client: BufferClient) -> None:
    """A page that read records but kept none of the asked states still names where it
    stopped, so the next page goes on from there instead of reading the first again."""
    client.create_dataset("t", "math", 5)
    claim = client.claim("t", "math", 5, lease_seconds=60)
    assert client.release_claims(claim.prompts[3:]) == 2  # prompts 3 and 4 are pending again
    found, after, pages = [], None, 0
    while pages < 10:
        page = client.list_prompts("t", "math", states=["pending"], after=after, limit=2)
        found += [(p.index, p.attempt) for p in page.prompts]
        pages += 1
        if page.done:
            break
        after = page.after
    assert (found, pages) == ([(3, 1), (4, 1)], 3)


def test_a_claims_owner_is_bounded_and_a_longer_one_stores_nothing(client: BufferClient) -> None:
    """The owner is stored in every claimed prompt's record and repeated in replies: one longer
    than its bound is refused by name before anything is claimed."""
    client.create_dataset("t", "math", 4)
    with pytest.raises(InvalidArgumentError, match=r"owner is 257 bytes; .* at most 256 bytes"):
        client.claim("t", "math", 4, owner="é" * 128 + "x")
    info = client.ledger("t", "math")
    assert (info.total("claimed"), info.cursor_position, client.list_prompts("t", "math").prompts) == (0, 0, [])
    (prompt,) = client.claim("t", "math", owner="é" * 128).prompts  # 256 bytes of UTF-8
    assert prompt.owner == "é" * 128
    assert [p.owner for p in client.list_prompts("t", "math").prompts] == ["é" * 128]


def test_a_claim_whose_reply_could_not_be_sent_is_refused_before_it_claims(start_server: Servers) -> None:
    """A claim's reply, counted with its owner and dataset name at their bounds and every number
    of its prompts at its largest, fits the server's largest message: a claim of more prompts is
    refused, naming count and the most its reply holds, and claims nothing."""
    server = start_server(max_message_bytes=1 << 16)
    owner, name = "o" * 256, "d" * 64
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=2)
        client.create_dataset("t", name, 2**40, epochs=2**20, seed=-1, max_attempts=1000)
        with pytest.raises(InvalidArgumentError, match=rf"count is {MAX}; .* holds at most (\d+) prompts") as refused:
            client.claim("t", name, MAX, owner=owner)
        most = int(re.search(r"holds at most (\d+) prompts", str(refused.value)).group(1))
        assert 0 < most < MAX
        assert client.ledger("t", name).total("claimed") == 0
        with pytest.raises(InvalidArgumentError, match=rf"count is {most + 1}; "):
            client.claim("t", name, most + 1, owner=owner)
        claim = client.claim("t", name, most, owner=owner)
        assert len(claim.prompts) == most and {p.owner for p in claim.prompts} == {owner}
        assert client.ledger("t", name).total("claimed") == most


def uids(experiences: list[Experience]) -> list[str]:
    return [e.eid.uid for e in experiences]


def test_only_the_claims_token_pushes_its_prompts_group(start_server: Servers) -> None:
    """With tokens on, a push into the group of a prompt another token holds is refused whole,
    by unary Push, PushStream and a push in chunks alike: nothing of it is stored, and the claim
    and its holder's own push are untouched."""
    scopes = frozenset({"push", "sample", "admin"})
    server = start_server(tokens={"a": scopes, "b": scopes})
    target = f"127.0.0.1:{server.port}"
    with (
        BufferClient(target, token="a", timeout=20) as a,
        BufferClient(target, token="b", timeout=20) as b,
        BufferClient(target, token="b", timeout=20, push_chunk_bytes=1 << 16) as chunked,
    ):
        a.create_table("t", group_size=2, estimator="grpo")
        a.create_dataset("t", "math", 4)
        (held,) = a.claim("t", "math", lease_seconds=60).prompts
        (own,) = b.claim("t", "math", lease_seconds=60).prompts
        theirs = group(held, range(2))
        with pytest.raises(PermissionDeniedError, match=rf"prompt math/0/{held.index}, claimed with another token"):
            b.push(theirs, table="t")
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):  # one group refused: all are
            b.push(group(own, range(2)) + theirs, table="t")
        with b.pusher("t") as pusher, pytest.raises(PermissionDeniedError, match="claimed with another token"):
            pusher.push(theirs).result(timeout=20)
        large = group(held, range(2), response=20_000)  # a payload of several chunks
        with pytest.raises(PermissionDeniedError, match="claimed with another token"):
            chunked.push(large, table="t")
        found = a.get(uids(theirs) + uids(group(own, range(2))), table="t")
        assert len(found) == 0 and a.stats("t")["t"].pushed == 0
        assert a.renew_claims([held], 60) == [] and b.renew_claims([own], 60) == []
        assert a.push(theirs, table="t").stored == uids(theirs)
        assert b.push(group(own, range(2)), table="t").stored == uids(group(own, range(2)))
        info = a.ledger("t", "math")
        assert (info.total("claimed"), info.total("generated")) == (0, 2)


def test_a_push_into_an_attempt_no_claim_holds_is_refused(client: BufferClient) -> None:
    """A prompt's group ids are predictable: a push into an attempt not handed out yet (a prompt
    never claimed, or an attempt past the prompt's) is refused and stores nothing, so that it
    cannot block the claimant to come. A group of the dataset's name that is no prompt's is a
    group like any other."""
    client.create_dataset("t", "math", 2)
    (first,) = client.claim("t", "math", lease_seconds=60).prompts
    later = Prompt("math", 0, 1 - first.index, 0, "math/0", f"{1 - first.index}@0", 0.0, table="t")
    with pytest.raises(FailedPreconditionError, match=rf"attempt 0 of prompt math/0/{later.index}, which no claim"):
        client.push(group(later, range(2)), table="t")
    ahead = Prompt("math", 0, first.index, 1, "math/0", f"{first.index}@1", 0.0, table="t")
    with pytest.raises(FailedPreconditionError, match=rf"attempt 1 of prompt math/0/{first.index}, which no claim"):
        client.push(group(ahead, range(2)), table="t")
    assert client.stats("t")["t"].pushed == 0
    (second,) = client.claim("t", "math", lease_seconds=60).prompts
    assert second.index == later.index
    assert len(client.push(group(second, range(2)), table="t").stored) == 2
    other = Prompt("math", 0, 0, 0, "math/0", "0", 0.0, table="t")  # task "0": no attempt, no prompt's group
    assert len(client.push(group(other, range(2)), table="t").stored) == 2


def test_a_claims_wait_is_a_number_of_seconds(client: BufferClient, server: ExpbufServer) -> None:
    """wait_seconds NaN was taken as no wait: it, the infinities and a negative wait are refused
    by name, and claim nothing."""
    client.create_dataset("t", "math", 2)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for wait in (math.nan, math.inf, -math.inf, -1.0):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Claim(pb.ClaimRequest(table="t", dataset="math", count=1, lease_seconds=60, wait_seconds=wait))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, wait
            assert "wait_seconds" in refused.value.details(), wait
    assert client.ledger("t", "math").total("claimed") == 0


def test_a_seed_takes_the_whole_int64_range(client: BufferClient) -> None:
    for seed in (-(2**63), 2**63 - 1):
        info = client.create_dataset("t", f"s{seed & 1}", 5, seed=seed)
        assert info.seed == seed
        claim = client.claim("t", info.name, 5)
        assert sorted(p.index for p in claim.prompts) == list(range(5))


def test_a_dataset_of_many_epochs_costs_its_reader_only_the_epochs_started(
    client: BufferClient, server: ExpbufServer
) -> None:
    """ListDatasets of a dataset of 2**20 epochs (the most allowed) carries the epochs started
    and the totals over all of them, not a row per epoch: a trainer reads it every step."""
    client.create_dataset("t", "long", 10, epochs=2**20)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = pb_grpc.ExperienceBufferStub(channel).ListDatasets(pb.ListDatasetsRequest(table="t", name="long"))
    assert reply.ByteSize() < 256
    info = client.ledger("t", "long")
    assert (len(info.counts), info.counts[0].pending, info.total("pending"), info.done) == (1, 10, 10 * 2**20, False)
    claim = client.claim("t", "long", 11)
    info = client.ledger("t", "long")
    assert [(c.pending, c.claimed) for c in info.counts] == [(0, 10), (9, 1)]
    assert (info.total("claimed"), info.total("pending")) == (11, 10 * 2**20 - 11)
    assert len(claim.prompts) == 11


def test_a_sharded_dataset_of_many_epochs_costs_its_shards_only_the_epochs_started(
    start_server: Servers, tmp_path: Path
) -> None:
    """A dataset of 2**20 epochs over three shards: each shard counts and stores its part of the
    epochs started, not of every epoch, so the create answers and each shard's ListDatasets reply
    is as small as one server's; the sharded client's totals are over every epoch."""
    names = ("s0", "s1", "s2")
    targets = {name: f"127.0.0.1:{start_server(data=tmp_path / name, shard=name).port}" for name in names}
    with ShardedBufferClient(targets, timeout=20) as sharded:
        sharded.create_table("t", group_size=2, estimator="grpo")
        info = sharded.create_dataset("t", "long", 10, epochs=2**20)
        assert (len(info.counts), info.total("pending"), info.owned, info.done) == (1, 10 * 2**20, 10 * 2**20, False)
        for target in targets.values():
            with grpc.insecure_channel(target) as channel:
                reply = pb_grpc.ExperienceBufferStub(channel).ListDatasets(
                    pb.ListDatasetsRequest(table="t", name="long")
                )
            assert reply.ByteSize() < 256
        claim = sharded.claim("t", "long", 40)  # claims run at most two epochs at once: epochs 0 and 1
        info = sharded.ledger("t", "long")
        assert (len(claim.prompts), info.total("claimed"), info.total("pending")) == (20, 20, 10 * 2**20 - 20)
        assert len(info.counts) <= 3 and sum(c.claimed for c in info.counts) == 20


def test_on_shards_only_the_claims_token_pushes_its_prompts_group(start_server: Servers, tmp_path: Path) -> None:
    """A sharded table: each prompt's group goes to the shard that handed it out, which refuses
    another token's push of it, whole, and stores its claimant's."""
    scopes = frozenset({"push", "sample", "admin"})
    tokens = {"a": scopes, "b": scopes}
    targets = {
        name: f"127.0.0.1:{start_server(data=tmp_path / name, shard=name, tokens=tokens).port}" for name in ("s0", "s1")
    }
    with (
        ShardedBufferClient(targets, token="a", timeout=20) as a,
        ShardedBufferClient(targets, token="b", timeout=20) as b,
    ):
        a.create_table("t", group_size=2, estimator="grpo")
        a.create_dataset("t", "math", 8)
        held = a.claim("t", "math", 8, lease_seconds=60).prompts
        assert {a.shard_map.owner(prompt.group) for prompt in held} == {"s0", "s1"}
        for prompt in held:
            with pytest.raises(BufferError, match="claimed with another token") as refused:
                b.push(group(prompt, range(2)), table="t")
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert sum(stats["t"].pushed for stats in a.shard_stats("t").values()) == 0
        for prompt in held:
            assert len(a.push(group(prompt, range(2)), table="t").stored) == 2
        assert a.ledger("t", "math").total("generated") == 8


def test_a_page_of_prompts_holds_what_one_reply_carries(start_server: Servers, tmp_path: Path) -> None:
    """ListPrompts reads no more prompts than one reply carries with their owners at the bound,
    and shows an owner stored before the bound cut to it: paging goes on to the last prompt."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of(name="t", group_size=2))
        store.claims.create("t", DatasetRecord("math", size=600))
        store.claims.claim("t", "math", 600, seconds=600, owner="o" * 256)
        table_id, _ = store.catalog.lookup("t")
        key = prompt_key(table_id, "math", 0, 0)

        def longer(txn: lmdb.Transaction[bytes]) -> None:  # an owner written before owners were bounded
            rec = PromptRecord.decode(txn.get(key, db=store.catalog.db["ledger"]))
            rec.owner = "é" * (1 << 17)
            txn.put(key, rec.encode(), db=store.catalog.db["ledger"])

        store.environment.submit(longer)
    server = start_server(data=data, max_message_bytes=1 << 16)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        first = client.list_prompts("t", "math", limit=10000)
        assert 0 < len(first.prompts) < 600 and not first.done
        assert first.prompts[0].owner == "é" * 128  # 256 bytes
        seen, page = [p.index for p in first.prompts], first
        while not page.done:
            page = client.list_prompts("t", "math", after=page.after, limit=10000)
            seen += [p.index for p in page.prompts]
        assert seen == list(range(600))


def expiries(client: BufferClient, table: str = "t", dataset: str = "math") -> dict[tuple[int, int], float]:
    """When each claim of the dataset ends, by prompt, read page by page."""
    out, page = {}, None
    while page is None or not page.done:
        page = client.list_prompts(table, dataset, states=["claimed"], after=page.after if page else None)
        out.update({(p.epoch, p.index): p.expires for p in page.prompts})
    return out


def test_a_call_names_at_most_so_many_prompts_and_one_naming_more_changes_nothing(
    client: BufferClient, server: ExpbufServer
) -> None:
    """A Claim hands out, and a RenewClaims or a ReleaseClaims names, at most MAX_PROMPTS_PER_CALL
    prompts: the server's one writer works through them in one transaction, every other tenant's
    writes waiting (a claim of 65,536 held it for seconds). One over is refused by name, before
    anything is looked up, and changes nothing."""
    client.create_dataset("t", "math", MAX + 1)
    with pytest.raises(InvalidArgumentError, match=rf"count is {MAX + 1}; a claim asks for 1 to {MAX} prompts"):
        client.claim("t", "math", MAX + 1)
    info = client.ledger("t", "math")
    assert (info.total("claimed"), info.cursor_position) == (0, 0)
    held = (
        client.claim("t", "math", MAX, lease_seconds=60).prompts + client.claim("t", "math", lease_seconds=60).prompts
    )
    before = expiries(client)
    assert len(before) == MAX + 1
    refs = [pb.PromptRef(epoch=p.epoch, index=p.index, attempt=p.attempt) for p in held]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for call, request in (
            ("RenewClaims", pb.RenewClaimsRequest(table="t", dataset="math", prompts=refs, lease_seconds=600)),
            ("ReleaseClaims", pb.ReleaseClaimsRequest(table="t", dataset="math", prompts=refs)),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub, call)(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, call
            assert f"prompts names {MAX + 1}; a {call} names at most {MAX}" in refused.value.details()
    assert expiries(client) == before
    assert client.ledger("t", "math").total("claimed") == MAX + 1


def test_the_clients_renew_and_release_any_number_of_claims(client: BufferClient, server: ExpbufServer) -> None:
    """The blocking and the asyncio clients renew and release more claims than one call may name
    in calls of at most MAX_PROMPTS_PER_CALL each: no caller's code changes."""
    client.create_dataset("t", "math", MAX + 1)
    held = (
        client.claim("t", "math", MAX, lease_seconds=60).prompts + client.claim("t", "math", lease_seconds=60).prompts
    )
    before = expiries(client)
    assert client.renew_claims(held, 600) == []
    renewed = expiries(client)
    assert renewed.keys() == before.keys() and all(renewed[key] > before[key] + 500 for key in before)

    async def run() -> tuple[list[Prompt], int]:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}", timeout=20) as aclient:
            return await aclient.renew_claims(held, 900), await aclient.release_claims(held[1:])

    assert asyncio.run(run()) == ([], MAX)
    assert client.release_claims(held) == 1
    info = client.ledger("t", "math")
    assert (info.total("claimed"), info.reissued) == (0, MAX + 1)


def test_the_sharded_clients_renew_and_release_any_number_of_claims(start_server: Servers, tmp_path: Path) -> None:
    """The sharded clients send each shard its prompts' renewals and releases, in calls of at
    most MAX_PROMPTS_PER_CALL."""
    targets = {name: f"127.0.0.1:{start_server(data=tmp_path / name, shard=name).port}" for name in ("s0", "s1")}
    with ShardedBufferClient(targets, timeout=30) as sharded:
        sharded.create_table("t", group_size=2)
        sharded.create_dataset("t", "math", 3 * MAX)
        held = [p for _ in range(3) for p in sharded.claim("t", "math", MAX, lease_seconds=60).prompts]
        assert len(held) == 3 * MAX
        assert max(Counter(sharded.shard_map.owner(p.group) for p in held).values()) > MAX
        assert sharded.renew_claims(held, 600) == []

        async def run() -> int:
            async with AsyncShardedBufferClient(targets, timeout=30) as aclient:
                assert await aclient.renew_claims(held, 900) == []
                return await aclient.release_claims(held[1:])

        assert asyncio.run(run()) == 3 * MAX - 1
        assert sharded.release_claims(held) == 1
        assert sharded.ledger("t", "math").reissued == 3 * MAX


def test_groups_pushed_under_a_dataset_name_before_it_existed_block_no_prompt(client: BufferClient) -> None:
    """Before a dataset exists the server cannot tell its prompts' groups from any other, so a
    push under its name is a group like any other; a claim never hands out an attempt whose
    group the table holds, so a dataset created over such groups hands out the next attempt of
    their prompts, and its claimants' groups complete."""
    squatted = [Prompt("math", 0, index, 0, "math/0", f"{index}@0", 0.0, table="t") for index in (0, 1)]
    assert len(client.push(group(squatted[0], range(2)), table="t").stored) == 2  # complete
    assert len(client.push(group(squatted[1], range(1)), table="t").stored) == 1  # incomplete
    assert client.create_dataset("t", "math", 3).total("pending") == 3
    claim = client.claim("t", "math", 3, lease_seconds=60)
    assert [(p.index, p.attempt) for p in claim.prompts] == [(0, 1), (1, 1), (2, 0)]
    for prompt in claim.prompts:
        assert len(client.push(group(prompt, range(2)), table="t").stored) == 2
    with pytest.raises(FailedPreconditionError, match="attempt 0 of prompt math/0/1, which no claim holds"):
        client.push(group(squatted[1], range(1, 2)), table="t")
    info = client.ledger("t", "math")
    assert (info.total("generated"), info.total("claimed"), info.reissued) == (3, 0, 0)


def test_a_create_whose_reply_could_not_be_sent_is_refused_before_it_stores(start_server: Servers) -> None:
    """CreateDataset's reply repeats the dataset's settings, its shards' names among them, with
    its counts: a create whose request just fits the server's max_message_bytes would commit
    and fail to send its reply. It is refused by name before it stores anything."""
    limit = 1 << 16  # the least a server takes
    server = start_server(max_message_bytes=limit)
    config = pb.DatasetConfig(name="d", size=10, epochs=2, seed=-1, max_attempts=1000)
    request = pb.CreateDatasetRequest(table="t", config=config)
    while request.ByteSize() <= limit - 2:  # shard names of 63 characters, the last cut to fit the bound
        request.config.shards.append(f"s{len(request.config.shards):04d}".ljust(63, "x"))
        request.config.shard = request.config.shards[0]
    while request.ByteSize() > limit - 2:
        request.config.shards[-1] = request.config.shards[-1][:-1]
    with (
        BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        client.create_table("t", group_size=2)
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.ExperienceBufferStub(channel).CreateDataset(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(
            rf"the reply would take up to \d+ bytes, over the server's max_message_bytes = {limit}: it repeats"
            rf" the settings, the names of {len(request.config.shards)} shards among them",
            refused.value.details(),
        )
        assert client.datasets("t") == []
        del request.config.shards[len(request.config.shards) // 2 :]  # its reply fits, and the name is free
        created = pb_grpc.ExperienceBufferStub(channel).CreateDataset(request)
        assert created.created and list(created.dataset.config.shards) == sorted(request.config.shards)


SMALL = 8192  # a client's max_message_bytes: a claim's reply of a few dozen prompts is larger
RECEIVES_LITTLE = {"max_message_bytes": SMALL, "push_chunk_bytes": 0, "timeout": 20}  # chunks fit its messages
OWNER = "w" * 200


def sent_back(client: BufferClient, dataset: str, count: int) -> list[tuple[int, int, str]]:
    """Claim `count` prompts and give them back: each is pending, attempt 1, and listed."""
    assert client.release_claims(client.claim("t", dataset, count, lease_seconds=60).prompts) == count
    return listed(client, dataset)


def listed(client: BufferClient, dataset: str) -> list[tuple[int, int, str]]:
    return [(p.index, p.attempt, p.state) for p in client.list_prompts("t", dataset).prompts]


def fits_in(refusal: ResourceExhaustedError) -> int:
    """The count a refusal of a claim too large for its client says would fit."""
    found = re.search(r"at most (\d+) prompts fit", str(refusal))
    assert found, str(refusal)
    return int(found[1])


def test_a_claim_whose_reply_the_client_cannot_receive_is_refused_before_it_claims(
    client: BufferClient, server: ExpbufServer
) -> None:
    """A client says what it receives (ClaimRequest.max_reply_bytes, its max_message_bytes): a
    claim whose reply could be larger is refused RESOURCE_EXHAUSTED, naming the count that
    fits, and claims nothing, where its claims were committed and the reply failed at the client,
    the prompts held until their lease ended. The blocking and the asyncio clients send it."""
    client.create_dataset("t", "math", 64)
    before = sent_back(client, "math", 64)
    assert {state for *_, state in before} == {"pending"}
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, **RECEIVES_LITTLE) as small:
        with pytest.raises(ResourceExhaustedError, match=f"max_message_bytes = {SMALL}") as refused:
            small.claim("t", "math", 64, owner=OWNER, lease_seconds=600)
        assert refused.value.reason == Reason.TOO_LARGE
        assert listed(client, "math") == before and client.ledger("t", "math").total("claimed") == 0
        fits = fits_in(refused.value)
        assert 0 < fits < 64
        assert len(small.claim("t", "math", fits, owner=OWNER, lease_seconds=600).prompts) == fits

    async def run() -> ResourceExhaustedError:
        async with AsyncBufferClient(target, **RECEIVES_LITTLE) as aclient:
            with pytest.raises(ResourceExhaustedError) as arefused:
                await aclient.claim("t", "math", 64, owner=OWNER, lease_seconds=600)
            return arefused.value

    arefused = asyncio.run(run())
    assert (arefused.reason, fits_in(arefused)) == (Reason.TOO_LARGE, fits)
    assert client.ledger("t", "math").total("claimed") == fits
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as odd:
        pb_grpc.ExperienceBufferStub(channel).Claim(
            pb.ClaimRequest(table="t", dataset="math", count=1, lease_seconds=60, max_reply_bytes=100)
        )
    assert odd.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_reply_bytes = 100; it must be 0" in odd.value.details()


def test_a_sharded_claim_whose_reply_a_shard_could_not_send_its_client_claims_nothing(
    start_server: Servers, tmp_path: Path
) -> None:
    """The sharded clients send each shard their max_message_bytes with each claim: a part too
    large for it is refused by its shard before anything is claimed there."""
    targets = {name: f"127.0.0.1:{start_server(data=tmp_path / name, shard=name).port}" for name in ("s0", "s1")}
    with ShardedBufferClient(targets, timeout=20) as sharded:
        sharded.create_table("t", group_size=2)
        sharded.create_dataset("t", "math", 200)
        with ShardedBufferClient(targets, **RECEIVES_LITTLE) as small:
            with pytest.raises(BufferError, match=f"max_message_bytes = {SMALL}") as refused:
                small.claim("t", "math", 200, owner=OWNER)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.reason == Reason.TOO_LARGE

            async def run() -> BufferError:
                async with AsyncShardedBufferClient(targets, **RECEIVES_LITTLE) as aclient:
                    with pytest.raises(BufferError) as arefused:
                        await aclient.claim("t", "math", 200, owner=OWNER)
                    return arefused.value

            assert asyncio.run(run()).reason == Reason.TOO_LARGE
        info = sharded.ledger("t", "math")
        assert (info.total("claimed"), info.total("pending")) == (0, 200)
