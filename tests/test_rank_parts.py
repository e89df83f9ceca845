"""A leased step spread over data-parallel ranks (ReadFields by lease, `read_part`): whole groups,
every group on exactly one rank, loads balanced by Karmarkar-Karp (schema/balance.py), the same
part for a rank each time it asks while the lease holds. A real server on loopback, real LMDB."""

from __future__ import annotations

import itertools
import random

import grpc
import pytest
import torch

from expbuf.client import BufferClient, InvalidArgumentError, NotFoundError, PermissionDeniedError, trxp
from expbuf.client.schema.balance import COSTS, MAX_RANKS, WORK, ModelShape, group_cost, parts, register_cost
from expbuf.client.schema.experience import EID, Experience
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from conftest import Servers


def optimum(costs: list[int], ranks: int) -> int:
    """The smallest largest load of any split (every assignment tried)."""
    return min(
        max(sum(cost for cost, at in zip(costs, assign, strict=True) if at == rank) for rank in range(ranks))
        for assign in itertools.product(range(ranks), repeat=len(costs))
    )


def test_every_group_lands_on_one_rank_and_the_split_is_near_the_optimum() -> None:
    rng = random.Random(7)
    worst = 1.0
    for _ in range(200):
        costs = [rng.randint(0, 100) for _ in range(rng.randint(0, 8))]
        ranks = rng.randint(1, 4)
        split = parts(costs, ranks)
        assert len(split) == ranks and sorted(i for part in split for i in part) == list(range(len(costs)))
        assert split == parts(list(costs), ranks)  # the same split each time
        largest = max(sum(costs[i] for i in part) for part in split)
        best = optimum(costs, ranks)
        worst = max(worst, largest / best if best else 1.0)
    assert worst < 1.15  # Karmarkar-Karp stays within a few percent on such small sets


def test_long_tailed_groups_balance_within_two_percent_of_the_ideal_at_eight_ranks() -> None:
    """Groups of 8 runs of 200 to 32k tokens, Pareto-tailed: the slowest of 8 ranks carries
    within 2% of the total over 8, where a split by count leaves far more on one rank."""
    rng = random.Random(3)
    costs = [sum(min(32_000, int(200 * rng.paretovariate(1.2))) for _ in range(8)) for _ in range(64)]
    split = parts(costs, 8)
    ideal = sum(costs) / 8
    assert max(sum(costs[i] for i in part) for part in split) <= 1.02 * ideal
    by_count = [costs[rank::8] for rank in range(8)]
    assert max(map(sum, by_count)) > 1.1 * ideal  # what balancing saves here


def test_a_step_too_large_for_karmarkar_karp_is_split_greedily_and_stays_balanced() -> None:
    """Past WORK groups x ranks, Karmarkar-Karp's lists would cost gigabytes (a request may name
    65,536 ranks): the heaviest group goes first onto the lightest rank, then moves refine it. More
    ranks than groups: one group a rank at most, the rest empty."""
    rng = random.Random(11)
    costs = [rng.randint(1_000, 300_000) for _ in range(40_000)]
    assert len(costs) * 64 > WORK
    split = parts(costs, 64)
    assert sorted(i for part in split for i in part) == list(range(len(costs)))
    assert max(sum(costs[i] for i in part) for part in split) <= 1.001 * sum(costs) / 64
    wide = parts(costs[:100], MAX_RANKS)
    assert len(wide) == MAX_RANKS and all(len(part) == 1 for part in wide[:100]) and not any(wide[100:])


def equal_optimum(costs: list[int], ranks: int) -> int:
    """The smallest largest load of any split whose ranks' counts differ by one at most."""
    most = -(-len(costs) // ranks)
    return min(
        max(sum(cost for cost, at in zip(costs, assign, strict=True) if at == rank) for rank in range(ranks))
        for assign in itertools.product(range(ranks), repeat=len(costs))
        if max(assign.count(rank) for rank in range(ranks)) <= most
        and min(assign.count(rank) for rank in range(ranks)) >= len(costs) // ranks
    )


def test_an_equal_split_gives_every_rank_as_many_groups_and_is_near_its_optimum() -> None:
    rng = random.Random(5)
    worst = 1.0
    for _ in range(150):
        costs = [rng.randint(0, 100) for _ in range(rng.randint(0, 8))]
        ranks = rng.randint(1, 4)
        split = parts(costs, ranks, equal=True)
        assert sorted(i for part in split for i in part) == list(range(len(costs)))
        counts = [len(part) for part in split[: min(ranks, len(costs))]]
        assert not counts or max(counts) - min(counts) <= 1
        assert split == parts(list(costs), ranks, equal=True)
        largest = max(sum(costs[i] for i in part) for part in split)
        best = equal_optimum(costs, ranks)
        worst = max(worst, largest / best if best else 1.0)
    assert worst < 1.2
    big = [rng.randint(1_000, 300_000) for _ in range(40_000)]  # greedy, past WORK: counts still equal
    assert {len(part) for part in parts(big, 64, equal=True)} == {625}
    big = [10**9, *big[:19_200]]  # one group heavier than all the rest: its rank still takes its share
    assert {len(part) for part in parts(big, 64, equal=True)} == {300, 301}


def test_bad_splits_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ranks: 0"):
        parts([1, 2], 0)
    with pytest.raises(ValueError, match="never negative"):
        parts([1, -2], 2)
    assert parts([], 3) == [[], [], []]


def rollout(task: int, run: int, response: int, reward: float | None = None) -> Experience:
    return Experience(
        eid=EID(batch=0, task=task, run=run),
        tokens=torch.arange(4 + response, dtype=torch.int32),
        prompt_length=4,
        logprobs=torch.full((response,), -0.5),
        reward=float(run) if reward is None else reward,
    )


def leased(client: BufferClient, table: str) -> tuple[dict[str, Experience], object]:
    """Eight groups of 4 runs whose lengths differ a lot; a lease of all of them."""
    client.create_table(table, group_size=4, estimator="grpo")
    made = [rollout(task, run, 10 * (task + 1) ** 2 + run) for task in range(8) for run in range(4)]
    client.push(trxp.encode(made), table=table)
    (batch,) = client.sample(table, num_groups=8, delivery="lease", max_batches=1, timeout=10, fields=["reward"])
    return {exp.eid.uid: exp for exp in made}, batch


def test_each_rank_reads_its_part_of_a_leased_step_whole_groups_balanced_by_tokens(client: BufferClient) -> None:
    made, batch = leased(client, "p")
    ranks = 3
    reads = [
        client.read_part(batch.lease_id, rank, ranks, ["tokens", "advantages"], table="p") for rank in range(ranks)
    ]
    uids = [uid for read in reads for uid in read.uids]
    assert sorted(uids) == sorted(batch.uids)  # every experience of the step once
    for read in reads:
        assert read.missing_uids == []
        for group in set(read.group_ids):  # whole groups: all 4 runs on this rank
            assert read.group_ids.count(group) == 4
        for k, uid in enumerate(read.uids):
            assert torch.equal(read.columns["tokens"].tensors[k], made[uid].tokens)
    # the loads: what Karmarkar-Karp gives over the groups' tokens, in the lease's group order
    groups = list(dict.fromkeys(batch.group_ids))
    pairs = list(zip(batch.uids, batch.group_ids, strict=True))
    tokens = [sum(int(made[uid].tokens.numel()) for uid, g in pairs if g == group) for group in groups]
    want = parts(tokens, ranks)
    for rank, read in enumerate(reads):
        assert list(dict.fromkeys(read.group_ids)) == [groups[i] for i in want[rank]]
    again = client.read_part(batch.lease_id, 1, ranks, ["tokens"], table="p")  # a rank come back
    assert again.uids == reads[1].uids
    for rank, read in enumerate(reads):  # the same part as whole experiences, for a framework's adapter
        got = client.get_part(batch.lease_id, rank, ranks, table="p")
        assert [exp.eid.uid for exp in got] == read.uids and got.missing_uids == []
        assert all(torch.equal(exp.tokens, made[exp.eid.uid].tokens) for exp in got)
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*balanse"):
        client.get_part(batch.lease_id, 0, ranks, table="p", balanse="count")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="name the fields to read"):
        client.read_part(batch.lease_id, 0, ranks, [], table="p")
    with pytest.raises(ValueError, match="name the fields to read"):
        client.read_fields(reads[0].uids, [], table="p")
    by_count = [client.read_part(batch.lease_id, rank, 4, ["tokens"], table="p", balance="count") for rank in range(4)]
    assert [len(read.uids) for read in by_count] == [8, 8, 8, 8]  # two groups of four runs each
    equal = [client.read_part(batch.lease_id, rank, 3, ["tokens"], table="p", equal=True) for rank in range(3)]
    assert sorted(len(set(read.group_ids)) for read in equal) == [2, 3, 3]  # 8 groups: 3, 3 and 2 a rank
    assert [list(dict.fromkeys(read.group_ids)) for read in equal] == [
        [groups[i] for i in part] for part in parts(tokens, 3, equal=True)
    ]
    assert batch.ack() == 32
    with pytest.raises(NotFoundError, match="holds no lease"):
        client.read_part(batch.lease_id, 0, ranks, ["tokens"], table="p")


def test_a_batch_splits_itself_as_read_part_splits_its_lease_whatever_its_delivery(client: BufferClient) -> None:
    """batch.rank_parts gives the uids read_part gives each rank of the batch's lease (the same
    rule, schema/balance.split_runs), from the batch's length or tokens column; a replayed batch,
    which has no lease, is split the same way and each rank reads its uids with read_fields."""
    made, _ = leased(client, "own")  # leases every group of table "own": nack it, then sample again
    client.nack(_.lease_id, table="own")
    (batch,) = client.sample("own", num_groups=8, delivery="lease", max_batches=1, timeout=10, fields=["length"])
    for options in ({}, {"equal": True}, {"balance": "count"}):
        want = [client.read_part(batch.lease_id, rank, 3, ["reward"], table="own", **options).uids for rank in range(3)]
        assert batch.rank_parts(3, **options) == want, options
    batch.nack()
    (replayed,) = client.sample("own", num_groups=8, delivery="replay", max_batches=1, timeout=10, fields=["tokens"])
    split = replayed.rank_parts(3)
    reads = [client.read_fields(uids, ["tokens"], table="own") for uids in split]
    assert sorted(uid for read in reads for uid in read.uids) == sorted(made)
    for read in reads:
        assert all(read.group_ids.count(group) == 4 for group in read.group_ids)
    (bare,) = client.sample("own", num_groups=8, delivery="replay", max_batches=1, timeout=10, fields=["reward"])
    with pytest.raises(ValueError, match="no length or tokens column"):
        bare.rank_parts(3)


def test_a_rank_reads_shares_of_its_part(client: BufferClient) -> None:
    made, batch = leased(client, "s")
    read = client.read_part(batch.lease_id, 0, 2, ["tokens"], table="s", share=1, of=2)
    for k, uid in enumerate(read.uids):
        length = made[uid].tokens.numel()
        assert torch.equal(read.columns["tokens"].tensors[k], made[uid].tokens[length // 2 :])


def test_bad_part_requests_are_refused_by_name(client: BufferClient, stub: pb_grpc.ExperienceBufferStub) -> None:
    _, batch = leased(client, "b")
    with pytest.raises(ValueError, match="rank 2 of 2"):
        client.read_part(batch.lease_id, 2, 2, ["tokens"], table="b")
    with pytest.raises(ValueError, match="balance 'flops' needs"):
        client.read_part(batch.lease_id, 0, 2, ["tokens"], table="b", balance="flops")
    cases = [
        (pb.ReadFieldsRequest(table="b", lease_id=batch.lease_id, rank=0, ranks=0), "rank 0 of 0 ranks"),
        (pb.ReadFieldsRequest(table="b", lease_id=batch.lease_id, rank=0, ranks=2, balance="x"), "balance 'x'"),
        (pb.ReadFieldsRequest(table="b", lease_id=batch.lease_id, uids=["u"], ranks=1), "not both"),
        (pb.ReadFieldsRequest(table="b", lease_id="nope", ranks=1), "holds no lease"),
        (pb.ReadFieldsRequest(table="b", lease_id=batch.lease_id, ranks=1, balance="flops"), "needs the model's shape"),
        (
            pb.ReadFieldsRequest(
                table="b", lease_id=batch.lease_id, ranks=1, balance="flops", model=pb.ModelShape(params=1, layers=0)
            ),
            "a model's shape is positive numbers",
        ),
    ]
    for request, words in cases:
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ReadFields(request, timeout=10))
        assert words in refused.value.details(), refused.value.details()
    assert batch.ack() == 32  # the lease stood through the refusals


def test_a_split_by_flops_weighs_long_runs_by_their_attention(client: BufferClient) -> None:
    """balance="flops": 6 N L + 12 l h L^2 a run; a model whose attention dominates puts the
    longest group alone on a rank where a split by tokens would not."""
    lengths = [1000, 700, 400, 300]  # groups of one run each
    model = ModelShape(params=1, layers=64, hidden=8192)
    flops = [group_cost("flops", [length], model) for length in lengths]
    assert flops[0] == 6 * 1000 + 12 * 64 * 8192 * 1000**2
    assert parts(lengths, 2) == [[0, 3], [1, 2]]  # by tokens: 1300 and 1100
    assert parts(flops, 2) == [[0], [1, 2, 3]]  # by FLOPs: the longest alone
    made, batch = leased(client, "f")
    by_flops = [
        client.read_part(batch.lease_id, r, 2, ["tokens", "cost"], table="f", balance="flops", model=model)
        for r in range(2)
    ]
    for read in by_flops:  # each run's estimate travels with it: what the split weighed it by
        assert read.columns["cost"].values.tolist() == [
            group_cost("flops", [int(made[uid].tokens.numel())], model) for uid in read.uids
        ]
    tokens = client.read_part(batch.lease_id, 0, 2, ["cost"], table="f")
    assert tokens.columns["cost"].values.tolist() == [int(made[uid].tokens.numel()) for uid in tokens.uids]
    assert "cost" not in client.read_fields(batch.uids, ["tokens", "cost"], table="f").columns  # not a part: no split
    assert sorted(uid for read in by_flops for uid in read.uids) == sorted(batch.uids)
    groups = list(dict.fromkeys(batch.group_ids))
    pairs = list(zip(batch.uids, batch.group_ids, strict=True))
    weights = [
        group_cost("flops", [int(made[u].tokens.numel()) for u, g in pairs if g == group], model) for group in groups
    ]
    want = parts(weights, 2)
    assert [list(dict.fromkeys(read.group_ids)) for read in by_flops] == [[groups[i] for i in part] for part in want]
    with pytest.raises(ValueError, match="needs the model's shape"):
        client.read_part(batch.lease_id, 0, 2, ["tokens"], table="f", balance="flops")


def test_a_cost_the_cost_column_cannot_hold_is_refused_by_name(client: BufferClient) -> None:
    """A run's FLOPs past an int64 (a 405B-class model over 700k tokens: 1.4e19) or a registered
    cost that is not an integer failed the read of the 'cost' field INTERNAL (struct.error); it is
    refused naming the run, and the part without 'cost' is read as split by it (a helper's audit)."""
    _, batch = leased(client, "o")
    huge = ModelShape(params=1, layers=2**32 - 1, hidden=2**32 - 1)
    with pytest.raises(
        InvalidArgumentError, match=r"costs \d+ by the read.s balance, which an int64 column does not hold"
    ):
        client.read_part(batch.lease_id, 0, 2, ["cost"], table="o", balance="flops", model=huge)
    parts_read = [
        client.read_part(batch.lease_id, r, 2, ["tokens"], table="o", balance="flops", model=huge) for r in (0, 1)
    ]
    assert sorted(uid for read in parts_read for uid in read.uids) == sorted(batch.uids)
    register_cost("halves", lambda length, model: length / 2)
    try:
        with pytest.raises(InvalidArgumentError, match=r"costs '?\d+\.\d+'?"):
            client.read_part(batch.lease_id, 0, 2, ["cost"], table="o", balance="halves")
    finally:
        COSTS.pop("halves")
    assert client.stats("o")["o"].leased == len(batch.uids)  # the lease stands


def test_a_cost_of_ones_own_is_one_registration(client: BufferClient) -> None:
    """A cost registered under a name (here in the test's own process, which runs its server) is
    what a request naming it splits by; a name twice is refused."""
    register_cost("response_heavy", lambda length, model: length * length)
    try:
        _, batch = leased(client, "c")
        reads = [
            client.read_part(batch.lease_id, r, 2, ["tokens"], table="c", balance="response_heavy") for r in range(2)
        ]
        assert sorted(uid for read in reads for uid in read.uids) == sorted(batch.uids)
        with pytest.raises(ValueError, match="registered already"):
            register_cost("response_heavy", lambda length, model: length)
    finally:
        COSTS.pop("response_heavy")
    with pytest.raises(InvalidArgumentError, match="balance 'response_heavy' is not one of"):
        client.read_part(batch.lease_id, 0, 2, ["tokens"], table="c", balance="response_heavy")


def test_with_tokens_on_only_the_token_that_leased_a_step_reads_its_parts(start_server: Servers) -> None:
    """As Ack and Renew are: a lease is bound to the token that took it."""
    server = start_server(tokens={"a": frozenset({"push", "sample", "admin"}), "b": frozenset({"push", "sample"})})
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="a", timeout=10) as a, BufferClient(target, token="b", timeout=10) as b:
        _, batch = leased(a, "o")
        with pytest.raises(PermissionDeniedError, match="taken with another token"):
            b.read_part(batch.lease_id, 0, 2, ["tokens"], table="o")
        mine = [a.read_part(batch.lease_id, rank, 2, ["tokens"], table="o") for rank in range(2)]
        assert sorted(uid for read in mine for uid in read.uids) == sorted(batch.uids)
        assert batch.ack() == 32


BATCH_STAGES = [
    ("reinforceplusplus", {}, {}),
    ("grpo", {"std_cal_level": "batch"}, {}),
    ("reinforce++_baseline", {}, {}),
    ("reinforce", {}, {"advantages_norm": True}),
]


@pytest.mark.parametrize(("estimator", "params", "shaping"), BATCH_STAGES)
def test_a_rank_gets_the_advantages_its_step_was_sampled_with(
    client: BufferClient, estimator: str, params: dict, shaping: dict
) -> None:
    """An estimator whose statistics are over the sampled batch (whitening, the batch's std)
    finishes a rank's part over the whole leased step, as the step was sampled and as a trainer
    computes them before it spreads the batch over its ranks, not over the rank's part alone."""
    table = f"stage-{estimator}-{len(params)}".replace("+", "p")
    client.create_table(table, group_size=4, estimator=estimator, estimator_params=params, shaping=shaping)
    rng = random.Random(1)
    made = [rollout(task, run, rng.randint(4, 30), reward=rng.uniform(-2, 2)) for task in range(6) for run in range(4)]
    client.push(trxp.encode(made), table=table)
    (batch,) = client.sample(table, num_groups=6, delivery="lease", max_batches=1, timeout=10)
    sampled = {exp.eid.uid: exp.advantages for exp in batch.experiences}
    for rank in range(2):
        read = client.read_part(batch.lease_id, rank, 2, ["advantages"], table=table)
        for uid, got in zip(read.uids, read.columns["advantages"].tensors, strict=True):
            assert torch.allclose(got, sampled[uid], atol=1e-6), (rank, uid)
        for exp in client.get_part(batch.lease_id, rank, 2, table=table):
            assert torch.allclose(exp.advantages, sampled[exp.eid.uid], atol=1e-6), (rank, exp.eid.uid)
    assert batch.ack() == 24
