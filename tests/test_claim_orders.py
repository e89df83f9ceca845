"""Claim orders by difficulty on the prompt ledger (issue 45): the pools order (prime-rl's
difficulty pools by the last group's mean reward) and the pass-rate order (Trinity-RFT's
diff_based Beta posterior near a target), each deterministic from its seed and the durable
statistics, so that after a kill -9 of the server the next claims are the ones a run without
kills makes; and what a dataset does with a prompt whose group's rewards are all equal (keep,
retry, skip for k epochs)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import lmdb
import pytest

from expbuf.client import AlreadyExistsError, BufferClient, InvalidArgumentError, Prompt, PromptStats
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1.buffer_pb2_grpc import ExperienceBufferStub
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.orders import PassRateOrder, PoolsOrder
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import Damaged
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from helpers import ServerProcess, make_experience, scrape, servers
from pages import code_blocks, page

PROMPTS, RUNS, EPOCHS, ROUND = 64, 4, 3, 16


def passes(index: int) -> int:
    """How many of a prompt's 4 runs pass: its known difficulty."""
    return index % (RUNS + 1)


def push_group(client: BufferClient, prompt: Prompt) -> None:
    """The prompt's group: its passing runs rewarded 1.0, the others 0.0 (pass_threshold 0.5)."""
    runs = []
    for run in range(RUNS):
        exp = make_experience(prompt.batch, prompt.task, run, reward=1.0 if run < passes(prompt.index) else 0.0)
        exp.eid = prompt.eid(run)
        runs.append(exp)
    client.push(runs, table="t")


ORDERS = {
    "pools": {"easy_share": 0.1, "hard_share": 0.2},
    "pass_rate": {"target": 0.5, "tau": 0.05},
}


def run_schedule(
    data: str, start: Callable[..., ServerProcess], order: str, kills: set[tuple[int, str]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, list[float]]], dict[int, PromptStats]]:
    """Rounds of ROUND prompts claimed, their groups pushed and trained (a lease acked) until the
    dataset is done, the server SIGKILLed at the (round, moment)s in `kills` ("claimed": before the
    round's pushes; "trained": after its ack). Returns the claims in the order handed out, the
    trainer's log of the groups it acked ((epoch, index, rewards)), and the last epoch's statistics."""
    server = start(data)
    claims: list[tuple[int, int, int]] = []
    log: list[tuple[int, int, list[float]]] = []
    client = BufferClient(server.target, timeout=60)
    try:
        client.create_table("t", group_size=RUNS, estimator="none")
        client.create_dataset(
            "t", "d", PROMPTS, epochs=EPOCHS, seed=11, pass_threshold=0.5, order=order, order_options=ORDERS[order]
        )
        for round_ in range(PROMPTS * EPOCHS // ROUND):
            claimed = client.claim("t", "d", ROUND, lease_seconds=600).prompts
            claims += [(p.epoch, p.index, p.attempt) for p in claimed]
            for moment in ("claimed", "trained"):
                if (round_, moment) in kills:
                    client.close()
                    server.proc.kill()
                    server.proc.wait(30)
                    server = start(data)
                    client = BufferClient(server.target, timeout=60)
                if moment == "claimed":
                    for prompt in claimed:
                        push_group(client, prompt)
                    (batch,) = client.sample("t", num_groups=ROUND, max_batches=1, timeout=30, delivery="lease")
                    groups: dict[str, list[float]] = {}
                    for exp in batch.experiences:
                        groups.setdefault(str(exp.eid.task), []).append(float(exp.reward))
                    assert batch.ack() == ROUND * RUNS
                    by_task = {p.task: p for p in claimed}
                    log += [(by_task[task].epoch, by_task[task].index, rewards) for task, rewards in groups.items()]
        assert client.ledger("t", "d").done
        page = client.list_prompts("t", "d", limit=10_000)
        stats = {p.index: p.stats for p in page.prompts if p.epoch == EPOCHS - 1 and p.stats is not None}
    finally:
        client.close()
        server.proc.kill()
        server.proc.wait(30)
    return claims, log, stats


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_the_orders_choices_after_two_kills_equal_those_of_a_run_without(tmp_path: Path, order: str) -> None:
    """64 prompts of known pass rates over 3 epochs, claimed, pushed and trained 16 at a time; the
    server is killed once with prompts claimed and not pushed, once after a round trained. The claims
    handed out equal, one by one, those of the same run without kills; every prompt's statistics
    equal those computed from the trainer's log; and the order put the prompts it favours first."""
    with servers() as start:
        calm = run_schedule(str(tmp_path / "calm"), start, order, set())
        killed = run_schedule(str(tmp_path / "killed"), start, order, {(3, "trained"), (6, "claimed")})
    assert killed[0] == calm[0]
    claims, log, stats = killed
    assert sorted((epoch, index) for epoch, index, _ in claims) == [
        (epoch, index) for epoch in range(EPOCHS) for index in range(PROMPTS)
    ]
    assert sorted(stats) == list(range(PROMPTS))
    for index, got in stats.items():
        groups = [rewards for _, i, rewards in log if i == index]
        runs = [reward for rewards in groups for reward in rewards]
        last = groups[-1]
        mean = sum(last) / len(last)
        assert (got.generated, got.trained, got.runs, got.passes) == (
            len(groups),
            len(groups),
            len(runs),
            sum(reward > 0.5 for reward in runs),
        ), index
        assert math.isclose(got.last_mean, mean) and got.last_epoch == EPOCHS - 1
        assert math.isclose(got.last_var, sum((r - mean) ** 2 for r in last) / len(last))
    later = [index for epoch, index, _ in claims if epoch == 1]
    first = later[: PROMPTS // 4]
    if order == "pools":  # medium (1-3 of 4 passed) drawn 70% of the time, easy (4 of 4) 10%
        medium = sum(1 for index in first if passes(index) in (1, 2, 3))
        assert medium >= len(first) // 2, first
        easy_at = [at for at, index in enumerate(later) if passes(index) == RUNS]
        assert sum(easy_at) / len(easy_at) > len(later) / 2  # the easy pool mostly goes last
    else:  # 2 of 4 passed: an estimate of (2 + 1) / (4 + 2) = 0.5, the target
        near = sum(1 for index in first if passes(index) == 2)
        assert near >= len(first) // 2, first


def test_the_orders_bins_and_weights() -> None:
    pools = PoolsOrder({"easy_share": 0.25, "hard_share": 0.25})
    assert pools.bin(PromptStats()) == 1  # never generated: medium
    assert pools.bin(PromptStats(generated=1, last_mean=1.0)) == 0
    assert pools.bin(PromptStats(generated=1, last_mean=0.0)) == 2
    assert pools.bin(PromptStats(generated=1, last_mean=0.5)) == 1
    assert pools.weights([3, 0, 1]) == [0.25, 0.0, 0.25]  # an empty pool gives its share away
    assert PoolsOrder({"easy_share": 0.0, "hard_share": 1.0}).weights([2, 5, 0]) == [1.0, 1.0, 0.0]
    rate = PassRateOrder({"target": 0.8, "tau": 0.05})
    assert rate.bin(PromptStats()) == 10  # the Beta(1, 1) prior: an estimate of 0.5
    assert rate.bin(PromptStats(runs=8, passes=8)) == 18  # 9 / 10
    weights = rate.weights([1 if k in (10, 16) else 0 for k in range(20)])
    assert weights[16] == 1.0 and math.isclose(weights[10], math.exp(-5.0))  # |0.525 - 0.8| / 0.05, less the top's
    assert sum(1 for w in weights if w) == 2


def test_settings_out_of_range_are_refused_by_name(client: BufferClient) -> None:
    client.create_table("t", group_size=RUNS)
    bad = [
        ({"order": "easiest"}, "order is 'easiest'; expected one of permutation, pools, pass_rate"),
        ({"order": "pools", "order_options": {"easy": 0.1}}, "order 'pools' has no option 'easy'"),
        ({"order": "pools", "order_options": {"easy_share": 0.7, "hard_share": 0.6}}, "at most 1 together"),
        ({"order": "pass_rate", "order_options": {"tau": 0.0}}, "tau is 0.0; it must be 0.001 or more"),
        ({"zero_variance": "never"}, "zero_variance is 'never'; expected one of keep, retry, skip"),
        ({"zero_variance": "retry"}, "keeps such groups"),
        ({"order": "pools", "shards": ["a", "b"], "shard": "a"}, "takes the permutation order"),
        ({"zero_variance": "skip", "shards": ["a", "b"], "shard": "a"}, 'zero_variance "skip" needs the prompts'),
    ]
    for settings, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            client.create_dataset("t", "d", 8, **settings)
    with pytest.raises(ValueError, match="order_options is"):
        client.create_dataset("t", "d", 8, order="pools", order_options={"easy_share": "a lot"})
    assert client.datasets("t") == []
    info = client.create_dataset("t", "d", 8, order="pools", order_options={"easy_share": 0.3})
    assert info.order == "pools" and info.order_options == {
        "easy_share": 0.3, "hard_share": 0.1, "easy_above": 1.0, "hard_below": 0.0
    }  # fmt: skip
    again = client.create_dataset("t", "d", 8, order="pools", order_options={"easy_share": 0.3}, exist_ok=True)
    assert again.order_options == info.order_options


def test_zero_variance_skip_sits_a_prompt_out_for_its_epochs(client: BufferClient, server: ExpbufServer) -> None:
    """A prompt whose runs all passed or all failed is dropped with its group, sits out the next
    skip_epochs epochs (dropped at the cursor, never claimed) and is claimed again after."""
    client.create_table("t", group_size=RUNS, estimator="none", drop_zero_variance=True)
    client.create_dataset("t", "d", 10, epochs=4, seed=1, zero_variance="skip", skip_epochs=2, on_drop="retry")
    unvaried = {index for index in range(10) if passes(index) in (0, RUNS)}
    by_epoch: dict[int, set[int]] = {}
    while True:
        claimed = client.claim("t", "d", 10, lease_seconds=600).prompts
        if not claimed:
            break
        for prompt in claimed:
            by_epoch.setdefault(prompt.epoch, set()).add(prompt.index)
            push_group(client, prompt)
        varied = len(claimed) - sum(p.index in unvaried for p in claimed)
        if varied:
            (batch,) = client.sample("t", num_groups=varied, max_batches=1, timeout=10)
            assert batch.ack() == varied * RUNS
    everyone = set(range(10))
    assert by_epoch == {0: everyone, 1: everyone - unvaried, 2: everyone - unvaried, 3: everyone}
    info = client.ledger("t", "d")
    assert info.done and info.skipped == 2 * len(unvaried)
    assert [c.dropped for c in info.counts] == [len(unvaried)] * 4  # on_drop "retry" does not retry them
    assert all(p.attempt == 0 for p in client.list_prompts("t", "d", limit=100).prompts)
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_prompts_skipped_total", (("dataset", "d"), ("table", "t")))] == 2 * len(unvaried)


def test_a_group_with_a_reward_unknown_is_not_zero_variance(client: BufferClient) -> None:
    """The table trains a group one of whose rewards is unknown; its prompt does not sit out."""
    client.create_table("t", group_size=3, estimator="none", drop_zero_variance=True)
    client.create_dataset("t", "d", 1, epochs=2, zero_variance="skip")
    for epoch in range(2):
        (prompt,) = client.claim("t", "d", 1).prompts
        assert prompt.epoch == epoch
        runs = [make_experience(0, 0, run, reward=None if run == 0 else 1.0) for run in range(3)]
        for run, exp in enumerate(runs):
            exp.eid = prompt.eid(run)
        client.push(runs, table="t")
        (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=10)
        assert batch.ack() == 3
    info = client.ledger("t", "d")
    assert info.done and info.skipped == 0 and info.total("trained") == 2


def test_the_cursor_rests_at_the_next_epoch_once_an_epochs_bins_are_empty(tmp_path: Path) -> None:
    """A claim that takes a binned epoch's last prompt leaves the cursor at the next epoch's start
    (at the end, past the last epoch), as the permutation leaves it: the check finds it intact."""
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("d", size=4, epochs=3, seed=2, order="pass_rate"))
        for epoch in range(3):
            claimed = store.claims.claim("t", "d", 4, seconds=3600)[0]
            assert sorted(c.index for c in claimed) == [0, 1, 2, 3] and {c.epoch for c in claimed} == {epoch}
            (ds,) = store.claims.datasets("t", "d")
            assert (ds.cursor_epoch, ds.cursor_position) == (epoch + 1, 0)
            assert store.verify("t") == []
            # trained, so that the epoch after the next may start (claims run at most two epochs at once)
            store.claims.report("t", "d", [(c.epoch, c.index, c.attempt, [1.0, 0.0]) for c in claimed])
        assert store.claims.claim("t", "d", 4, seconds=3600)[0] == []


def test_zero_variance_retry_claims_the_prompt_again(client: BufferClient) -> None:
    """With the table dropping groups of equal rewards, the prompt goes out again with its next
    attempt, until max_attempts; a group that varies is trained as ever."""
    client.create_table("t", group_size=RUNS, estimator="none", drop_zero_variance=True)
    client.create_dataset("t", "d", 5, zero_variance="retry", max_attempts=3)
    attempts: dict[int, list[int]] = {}
    while True:
        claimed = client.claim("t", "d", 5, lease_seconds=600).prompts
        if not claimed:
            break
        for prompt in claimed:
            attempts.setdefault(prompt.index, []).append(prompt.attempt)
            push_group(client, prompt)
    assert attempts == {0: [0, 1, 2], 1: [0], 2: [0], 3: [0], 4: [0, 1, 2]}
    states = {p.index: p.state for p in client.list_prompts("t", "d").prompts}
    assert states == {0: "dropped", 1: "generated", 2: "generated", 3: "generated", 4: "dropped"}


def test_expbuf_check_finds_a_bin_that_disagrees_with_its_count(tmp_path: Path) -> None:
    """The check at open and `expbuf check` count each bin's prompts against the dataset record:
    a prompt lost from its bin would never go out in its epoch."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("d", size=6, epochs=2, seed=5, order="pools"))
        assert len(store.claims.claim("t", "d", 6, seconds=3600)[0]) == 6  # epoch 0: each one filed for epoch 1
        assert store.verify("t") == []
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    try:
        tables, ledger = env.open_db(b"tables"), env.open_db(b"ledger")
        with env.begin(write=True) as txn:
            table_id = json.loads(txn.get(b"t", db=tables))["id"]
            with txn.cursor(db=ledger) as cur:
                prefix = layout.table_prefix(table_id) + b"o"
                assert cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)
                cur.delete()
    finally:
        env.close()
    with pytest.raises(Damaged, match="dataset d: epoch 1's bin 1 holds 5 prompts, and its record counts 6"):
        Store(data, check_at_open="full")


def test_the_docs_curriculum_runs_as_written(server: ExpbufServer, capsys: pytest.CaptureFixture) -> None:
    code = code_blocks(page("concepts/prompt-ledger.md"), "python")[1]
    exec(compile(code.replace("127.0.0.1:50051", f"127.0.0.1:{server.port}"), "prompt-ledger.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "{'target': 0.5, 'tau': 0.1}"
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        info = client.ledger("curriculum8", "math")
    assert (info.order, info.zero_variance, info.skip_epochs, info.pass_threshold) == ("pass_rate", "skip", 2, 0.5)


def test_expbuf_dataset_export_writes_each_prompt_with_its_statistics(server: ExpbufServer, tmp_path: Path) -> None:
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=RUNS, estimator="none")
        client.create_dataset("t", "d", 5, pass_threshold=0.5)
        for prompt in client.claim("t", "d", 3).prompts:
            push_group(client, prompt)
        listed = client.list_prompts("t", "d").prompts
    out = tmp_path / "prompts.jsonl"
    done = cli_forks.run("dataset", "export", "t", "d", "--out", str(out), "--target", f"127.0.0.1:{server.port}")
    assert done.returncode == 0 and done.stderr.strip() == "3 prompts of dataset d", done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["epoch"], row["index"], row["state"]) for row in rows] == [(p.epoch, p.index, p.state) for p in listed]
    for row, prompt in zip(rows, listed, strict=True):
        assert prompt.stats is not None
        assert row["stats"]["runs"] == RUNS and row["stats"]["passes"] == passes(prompt.index)
        assert row["stats"]["pass_rate"] == passes(prompt.index) / RUNS
        assert row["stats"]["last_mean"] == prompt.stats.last_mean and row["stats"]["trained"] == 0
    nowhere = tmp_path / "no-such-dir" / "prompts.jsonl"  # a file that cannot be written: one line, exit code 2
    done = cli_forks.run("dataset", "export", "t", "d", "--out", str(nowhere), "--target", f"127.0.0.1:{server.port}")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and str(nowhere) in lines[0], done.stderr


def strict_json(line: str) -> dict[str, object]:
    """A line as a strict JSON parser reads it: NaN, Infinity and -Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_expbuf_dataset_export_is_strict_json_where_a_statistic_is_infinite(server: ExpbufServer) -> None:
    """Reported rewards whose mean or variance is past float's range give infinite statistics:
    exported as "inf" and "-inf" (as `expbuf export` writes them), NaN as null (none yet)."""
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=RUNS, estimator="none")
        client.create_dataset("t", "d", 4)
        high, low, spread, unreported = sorted(client.claim("t", "d", 4).prompts, key=lambda p: p.index)
        huge = sys.float_info.max
        client.report_prompts({high: [huge, huge], low: [-huge, -huge], spread: [1e200, -1e200]})
    done = cli_forks.run("dataset", "export", "t", "d", "--target", f"127.0.0.1:{server.port}")
    assert done.returncode == 0, done.stderr
    stats = {row["index"]: row["stats"] for row in map(strict_json, done.stdout.splitlines())}
    assert (stats[high.index]["last_mean"], stats[high.index]["last_var"]) == ("inf", "inf")
    assert (stats[low.index]["last_mean"], stats[low.index]["last_var"]) == ("-inf", "inf")
    assert (stats[spread.index]["last_mean"], stats[spread.index]["last_var"]) == (0.0, "inf")
    assert (stats[unreported.index]["last_mean"], stats[unreported.index]["pass_rate"]) == (None, None)


def test_prompts_trained_outside_expbuf_are_reported_with_their_rewards(client: BufferClient) -> None:
    """A framework whose own queue held a prompt's runs reports their rewards: the prompt is
    trained, its statistics take them, and a pass-rate order draws by them in the next epoch."""
    client.create_table("t", group_size=RUNS, estimator="none")
    client.create_dataset(
        "t", "d", 8, epochs=2, seed=4, pass_threshold=0.5, order="pass_rate", order_options={"tau": 0.01}
    )
    claimed = client.claim("t", "d", 8).prompts
    rate = {p.index: (p.index % 2) * 0.5 for p in claimed}  # odd prompts pass half their runs: the target
    outcomes = {p: [1.0] * int(RUNS * rate[p.index]) + [0.0] * (RUNS - int(RUNS * rate[p.index])) for p in claimed}
    with pytest.raises(ValueError, match=r"prompt d/0/\d+ has rewards \[nan\]"):
        client.report_prompts({claimed[0]: [math.nan]})
    with pytest.raises(ValueError, match=r"prompt d/0/\d+ has rewards 0.5; give the rewards of its runs, a list"):
        client.report_prompts({claimed[0]: 0.5})
    assert client.report_prompts(outcomes) == 8
    assert client.report_prompts(outcomes) == 8  # a report sent again (its reply lost) says what the first took
    info = client.ledger("t", "d")
    assert info.counts[0].trained == 8 and info.total("claimed") == 0
    stats = {p.index: p.stats for p in client.list_prompts("t", "d").prompts}
    for index, got in stats.items():
        assert got is not None and (got.generated, got.trained, got.runs) == (1, 1, RUNS)
        assert got.passes == int(RUNS * rate[index]) and math.isclose(got.last_mean, rate[index])
    later = [p.index for p in client.claim("t", "d", 8).prompts]
    assert {index % 2 for index in later[:4]} == {1}  # estimate (2 + 1) / (4 + 2) = 0.5 first


def test_a_report_of_a_prompt_whose_group_is_in_the_table_is_refused_whole(
    client: BufferClient, stub: ExperienceBufferStub
) -> None:
    client.create_table("t", group_size=RUNS, estimator="none")
    client.create_dataset("t", "d", 2)
    first, second = client.claim("t", "d", 2).prompts
    exp = make_experience(first.batch, first.task, 0)
    exp.eid = first.eid(0)
    client.push([exp], table="t")  # one run of four: its group is in the table
    with pytest.raises(AlreadyExistsError, match=r"prompt d/0/\d+ has its group .* in table 't'"):
        client.report_prompts({second: [1.0, 0.0], first: [1.0]})
    assert client.ledger("t", "d").total("claimed") == 2  # nothing of the report stored
    request = pb.ReportPromptsRequest(table="t", dataset="d")
    request.outcomes.add(prompt=pb.PromptRef(epoch=second.epoch, index=second.index), rewards=[math.inf])
    with pytest.raises(grpc.RpcError) as refused:
        stub.ReportPrompts(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one finite number or more" in str(
        refused.value.details()
    )
