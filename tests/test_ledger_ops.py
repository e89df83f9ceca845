"""The prompt ledger's operations side against a real server: `expbuf dataset create|list|
describe` in a child process (its refusals naming the setting), the ledger's series on a real
/metrics scrape, read back from LMDB after a restart, and the docs' worker and trainer (concepts/prompt-ledger.md)."""

from __future__ import annotations

import gc
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from expbuf.client import BufferClient, Experience, Prompt
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.interceptors.store_metrics import StoreCollector
from expbuf.server.store import Store
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from conftest import Servers
from helpers import make_experience, scrape
from pages import code_blocks, page

STATES = ("pending", "claimed", "generated", "trained", "dropped")


def cli(*args: str) -> subprocess.CompletedProcess:
    """`expbuf ARGS` in a child process (tests/cli_forks.py)."""
    return cli_forks.run(*args)


def one_line_error(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The command failed with `code` and one line on stderr holding every word."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def group(prompt: Prompt, runs: range) -> list[Experience]:
    """The experiences of one attempt at a prompt (rewards 0, 1, ...: never all equal)."""
    out = []
    for run in runs:
        exp = make_experience(0, 0, run, reward=float(run))
        exp.eid = prompt.eid(run)
        out.append(exp)
    return out


def wait_for(check, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server()


@pytest.fixture
def client(server: ExpbufServer) -> Iterator[BufferClient]:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("t", group_size=2, estimator="none")
        yield c


def every_state(client: BufferClient) -> dict[str, Prompt]:
    """Dataset math (4 prompts) with 0 trained, 1 sent back (its incomplete attempt dropped),
    2 claimed by worker-2, 3 pending; returns the prompts by what happened to them."""
    client.create_dataset("t", "math", 4)
    trained, released, claimed = client.claim("t", "math", 3, lease_seconds=600, owner="worker-2").prompts
    client.push(group(trained, range(2)), table="t")
    wait_for(lambda: client.ledger("t", "math").total("generated") == 1)
    batch = next(client.sample("t", num_groups=1, delivery="consume", timeout=10, max_batches=1))
    assert batch.groups == [trained.group]
    client.push(group(released, range(1)), table="t")
    assert client.release_claims([released]) == 1
    return {"trained": trained, "released": released, "claimed": claimed}


def series(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# ---- metrics ----------------------------------------------------------------------------


def test_metrics_count_prompts_by_state_and_survive_a_restart(
    start_server: Servers, server: ExpbufServer, client: BufferClient
) -> None:
    every_state(client)
    client.create_table("plain", estimator="none")
    m = scrape(server.metrics_port)
    by_state = {state: series(m, "expbuf_prompts", table="t", dataset="math", state=state) for state in STATES}
    assert by_state == {"pending": 2, "claimed": 1, "generated": 0, "trained": 1, "dropped": 0}
    assert series(m, "expbuf_prompt_claims_reissued_total", table="t", dataset="math") == 1
    assert series(m, "expbuf_prompt_attempts_dropped_total", table="t", dataset="math") == 1
    ledger = {name for name, _ in m if name.startswith("expbuf_prompt")}
    assert {dict(labels)["table"] for name, labels in m if name in ledger} == {"t"}  # no dataset, no series
    server.stop(grace=1)
    again = scrape(start_server().metrics_port)  # read from LMDB, not counted in memory
    assert {k: v for k, v in again.items() if k[0] in ledger} == {k: v for k, v in m.items() if k[0] in ledger}


def test_a_scrape_reads_each_tables_datasets_once(tmp_path: Path) -> None:
    """Once per table, and from the dataset records' totals alone: no epoch's counts are read."""
    reads: list[str] = []

    class Counting(Store):
        def datasets(self, table: str, name: str = "", *, by_epoch: bool = True) -> list[DatasetRecord]:
            reads.append(table if not by_epoch else f"{table} by epoch")
            return super().datasets(table, name, by_epoch=by_epoch)

    with Counting(tmp_path / "data") as store:
        for table in ("a", "b", "c"):
            store.create_table(TableConfig.of(name=table, estimator="none"))
            store.create_dataset(table, DatasetRecord("one", size=2))
            store.create_dataset(table, DatasetRecord("two", size=3))
        families = {family.name: family for family in StoreCollector(store).collect()}
        assert sorted(reads) == ["a", "b", "c", "default"]
        pending = {(s.labels["table"], s.labels["dataset"]): s.value for s in families["expbuf_prompts"].samples
                   if s.labels["state"] == "pending"}  # fmt: skip
        assert pending == {(t, d): n for t in "abc" for d, n in (("one", 2), ("two", 3))}


def test_a_scrape_of_many_tables_frees_each_read_as_it_goes(tmp_path: Path) -> None:
    """Reading a table's datasets builds its state on a read transaction: that transaction's
    LMDB reader slot (126 in all) is freed when the read ends, not at a garbage collection,
    so a scrape of hundreds of tables never runs the server out of readers."""
    with Store(tmp_path / "data") as store:
        for i in range(300):
            store.create_table(TableConfig.of(name=f"t{i}", estimator="none"))
        gc.disable()
        try:
            families = [family.name for family in StoreCollector(store).collect()]
            held = [line for line in store.environment.env.readers().splitlines()[1:] if line.strip()]
        finally:
            gc.enable()
        assert "expbuf_prompts" in families and held == []


# ---- the command line -------------------------------------------------------------------


def test_dataset_create_takes_settings_anywhere_and_refusals_name_the_setting(
    server: ExpbufServer, client: BufferClient
) -> None:
    target = ("--target", f"127.0.0.1:{server.port}")
    settings = ("epochs=2", "seed=7", "max_in_flight=3", "on_drop=retry", "max_attempts=4", "order=pools")
    settings += ("order_options={hard_share=0.3}",)
    made = cli("dataset", "create", "t", "math", "10", *settings, *target)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == (
        'dataset math on table t: size=10 epochs=2 seed=7 max_in_flight=3 on_drop="retry" max_attempts=4 '
        'pass_threshold=0.0 order="pools" order_options={ easy_above = 1.0, easy_share = 0.1, hard_below = 0.0, '
        'hard_share = 0.3 } zero_variance="keep" skip_epochs=1'
    )
    info = client.ledger("t", "math")
    assert (info.size, info.epochs, info.seed, info.max_in_flight, info.on_drop, info.max_attempts) == (
        10, 2, 7, 3, "retry", 4,
    )  # fmt: skip
    for order in (
        ("t", "math", "10", "--exist-ok", *settings),
        ("t", "math", "10", settings[0], "--exist-ok", *target, *settings[1:]),
        ("--exist-ok", "t", "math", "10", *settings),
    ):
        same = cli("dataset", "create", *order, *target)
        assert same.returncode == 0 and not same.stderr and same.stdout == made.stdout, (order, same.stderr)
    one_line_error(cli("dataset", "create", "t", "math", "10", *target), 1, "ALREADY_EXISTS", "math")
    differs = cli("dataset", "create", "t", "math", "10", "--exist-ok", "epochs=3", *target)
    one_line_error(differs, 1, "epochs: the dataset has 2, the request 3")
    # The server's refusals: exit code 1, its status and message, naming the setting.
    one_line_error(cli("dataset", "create", "t", "x", "0", *target), 1, "INVALID_ARGUMENT", "size is 0")
    one_line_error(cli("dataset", "create", "t", "x", "2", "max_attempts=5000", *target), 1, "max_attempts is 5000")
    one_line_error(cli("dataset", "create", "t", "x", "2", "on_drop=never", *target), 1, "on_drop is 'never'")
    one_line_error(cli("dataset", "create", "t", "x", "2", "order=hardest", *target), 1, "order is 'hardest'")
    one_line_error(cli("dataset", "create", "nope", "x", "2", *target), 1, "NOT_FOUND", "nope")
    # Mistakes caught before the call: exit code 2, one line naming the setting.
    one_line_error(cli("dataset", "create", "t", "x", "ten", *target), 2, "size", "'ten'")
    one_line_error(cli("dataset", "create", "t", "x", "2", "epochs=0", *target), 2, "epochs is 0")
    one_line_error(cli("dataset", "create", "t", "x", "2", "max_attempts=0", *target), 2, "max_attempts is 0")
    one_line_error(cli("dataset", "create", "t", "x", "2", "seed=1.5", *target), 2, "seed is 1.5")
    one_line_error(cli("dataset", "create", "t", "x", "-2", *target), 2, "size is -2")
    one_line_error(cli("dataset", "create", "t", "x", "2", "epoch=3", *target), 2, "unknown setting", "epoch")
    one_line_error(cli("dataset", "create", "t", "x", "2", "epochs", *target), 2, "KEY=VALUE")
    for setting, where in (
        ("table=u", "TABLE"),
        ("name=y", "NAME"),
        ("size=3", "SIZE"),
        ("exist_ok=true", "--exist-ok"),
    ):
        one_line_error(cli("dataset", "create", "t", "x", "2", setting, *target), 2, setting, where)
    one_line_error(cli("dataset", "create", "t", "x", "2", "epochs=2", "epochs=3", *target), 2, "epochs", "twice")
    assert [d.name for d in client.datasets("t")] == ["math"]  # nothing refused was made


def test_dataset_list_and_describe_show_counts_cursor_and_prompts(server: ExpbufServer, client: BufferClient) -> None:
    target = ("--target", f"127.0.0.1:{server.port}")
    prompts = every_state(client)
    client.create_dataset("t", "later", 3, epochs=2, seed=5)
    listing = cli("dataset", "list", "t", *target)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()]
    assert rows == [
        ["dataset", "size", "epochs", "pending", "claimed", "generated", "trained", "dropped", "cursor", "done"],
        ["later", "3", "2", "6", "0", "0", "0", "0", "0:0", "no"],
        ["math", "4", "1", "2", "1", "0", "1", "0", "0:3", "no"],
    ]
    described = cli("dataset", "describe", "t", "math", *target)
    assert described.returncode == 0, described.stderr
    settings, epochs, listed = described.stdout.split("\n\n")
    lines = settings.splitlines()
    assert lines[0] == "dataset math on table t"
    assert lines[1:12] == ["size = 4", "epochs = 1", "seed = unset (index order)", "max_in_flight = 0",
                          'on_drop = "done"', "max_attempts = 5", "pass_threshold = 0.0", 'order = "permutation"',
                          "order_options = {}", 'zero_variance = "keep"', "skip_epochs = 1"]  # fmt: skip
    assert lines[13:] == [
        "cursor = epoch 0, position 3", "reissued = 1", "attempts_dropped = 1", "skipped = 0", "done = false"
    ]  # fmt: skip
    assert [row.split() for row in epochs.splitlines()] == [
        ["epoch", "pending", "claimed", "generated", "trained", "dropped"],
        ["0", "2", "1", "0", "1", "0"],
    ]
    rows = [row.split() for row in listed.splitlines()]
    assert rows[0] == [
        "epoch",
        "index",
        "attempt",
        "state",
        "group",
        "owner",
        "expires",
        "runs",
        "pass_rate",
        "last_mean",
    ]
    trained, released, claimed = prompts["trained"], prompts["released"], prompts["claimed"]
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claimed.expires))
    assert rows[1:] == [
        ["0", "0", "0", "trained", trained.group, "worker-2", "-", "2", "0.500", "0.500"],  # rewards 0 and 1
        ["0", "1", "1", "pending", "math/0/1@1", "-", "-", "0", "-", "-"],
        ["0", "2", "0", "claimed", claimed.group, "worker-2", expires, "0", "-", "-"],
    ]
    assert released.index == 1
    only = cli("dataset", "describe", "t", "math", "--states", "claimed,pending", "--limit", "1", *target)
    assert only.returncode == 0, only.stderr
    listed = only.stdout.split("\n\n")[2].splitlines()
    assert [row.split()[:4] for row in listed[1:-1]] == [["0", "1", "1", "pending"]]
    assert listed[-1] == "(more prompts: raise --limit)"
    none = cli("dataset", "describe", "t", "math", "--limit", "0", *target)
    assert none.returncode == 0 and len(none.stdout.split("\n\n")) == 2
    one_line_error(cli("dataset", "describe", "t", "math", "--states", "claimd", *target), 2, "--states", "claimd")
    one_line_error(cli("dataset", "describe", "t", "math", "--limit", "-1", *target), 2, "--limit", "-1")
    one_line_error(cli("dataset", "describe", "t", "nope", *target), 1, "NOT_FOUND", "no dataset 'nope'")
    one_line_error(cli("dataset", "list", "nope", *target), 1, "NOT_FOUND", "nope")


def test_describe_of_a_shards_part_shows_what_it_owns_of_the_epochs_started(
    server: ExpbufServer, client: BufferClient
) -> None:
    """On one shard of a sharded dataset, describe names the part it owns of the epochs started,
    and shows no count for the epochs after: its part of an epoch is counted when it starts."""
    info = client.create_dataset("t", "part", 6, epochs=3, shards=["s0", "s1"], shard="s0")
    target = ("--target", f"127.0.0.1:{server.port}")
    described = cli("dataset", "describe", "t", "part", "--limit", "0", *target)
    assert described.returncode == 0, described.stderr
    settings, epochs = described.stdout.split("\n\n")
    assert f"owned = {info.owned} (the prompts this shard hands out of the epochs it started)" in settings.splitlines()
    assert [row.split() for row in epochs.splitlines()][1:] == [
        ["0", str(info.owned), "0", "0", "0", "0"],
        ["1..2", "-", "0", "0", "0", "0"],
    ]


def test_describe_pages_past_a_page_that_holds_none_of_the_states_asked_for(
    server: ExpbufServer, client: BufferClient
) -> None:
    """ListPrompts reads a bounded page and keeps the states asked for: a page may keep none
    and still not be the last; its `after` goes on from the last record read."""
    client.create_dataset("t", "big", 1005)
    prompts = client.claim("t", "big", 1005, lease_seconds=600).prompts
    assert client.release_claims(prompts[-1:]) == 1
    page = client.list_prompts("t", "big", states=["pending"])
    assert (page.prompts, page.done, page.after) == ([], False, (0, 999))
    (pending,) = client.list_prompts("t", "big", states=["pending"], after=page.after).prompts
    assert (pending.index, pending.attempt) == (1004, 1)
    target = ("--target", f"127.0.0.1:{server.port}")
    described = cli("dataset", "describe", "t", "big", "--states", "pending", *target)
    assert described.returncode == 0, described.stderr
    rows = [row.split() for row in described.stdout.split("\n\n")[2].splitlines()]
    assert rows[1:] == [["0", "1004", "1", "pending", "big/0/1004@1", "-", "-", "0", "-", "-"]]


def test_the_docs_rollout_worker_and_trainer_run_as_written(
    server: ExpbufServer, capsys: pytest.CaptureFixture
) -> None:
    """Every prompt of both epochs is trained once, in batches the trainer acked."""
    code = code_blocks(page("concepts/prompt-ledger.md"), "python")[0]
    steps: list[list[Experience]] = []

    def generate(index: int, n: int) -> list[Experience]:
        return [make_experience(0, index, run, reward=float(run)) for run in range(n)]

    scope = {"generate": generate, "train_step": steps.append}
    exec(
        compile(code.replace("127.0.0.1:50051", f"127.0.0.1:{server.port}"), "concepts/prompt-ledger.md", "exec"), scope
    )
    assert capsys.readouterr().out.strip() == "32"
    groups = [exp.eid.tid for step in steps for exp in step]
    assert len(groups) == 32 * 8 and len(set(groups)) == 32
    assert {tid.split("@")[0] for tid in groups} == {f"math/{e}/{i}" for e in range(2) for i in range(16)}
