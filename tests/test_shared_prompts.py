"""A group's shared prompt stored once (server/store/disk/shared_prompts.py): runs that carry the
same prompt tokens (compared by bytes) refer to one copy, counted; every read returns the
experiences as pushed; the copy goes with the last run that refers to it, whatever retires
the runs; damage to it is found by each run's read check. Real LMDB in a temporary directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lmdb
import pytest
import torch

from expbuf.client import BufferClient, InvalidArgumentError, trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Entry, Store
from expbuf.server.store.disk import digests, layout, shared_prompts
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from helpers import scrape, take

PROMPT = 512  # int64 tokens: 4 KiB, above shared_prompts.MIN_BYTES


def run(task: int, index: int, *, prompt: int = PROMPT, seed: int = 0) -> Experience:
    """One run of a task: the task's prompt (the same tokens for every run), a response of its own."""
    prompt_tokens = torch.randint(0, 50_000, (prompt,), generator=torch.Generator().manual_seed(1000 * seed + task))
    response = 16 + 8 * index
    return Experience(
        eid=EID(batch=0, task=task, run=index, suffix=f"r{index}"),
        tokens=torch.cat([prompt_tokens, torch.arange(response) + 100 * index]),
        prompt_length=prompt,
        logprobs=torch.linspace(-1, 0, response),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=float(index),
    )


def items(*experiences: Experience) -> list[trxp.RawItem]:
    return [trxp.from_experience(exp) for exp in experiences]


def whole(raw: list[trxp.RawItem]) -> list[trxp.RawItem]:
    """The items as a batch of them reads back."""
    return trxp.parse(trxp.join([trxp.pack_item(item) for item in raw]))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "data", map_size=64 << 20, seed=3) as s:
        s.create_table(TableConfig.of(name="t", estimator="none", group_size=4))
        yield s
        assert s.verify("t") == []


def shared(store: Store) -> dict[bytes, tuple[int, bytes]]:
    """The table's shared prompts: digest -> (how many refer to it, its bytes)."""
    db = store.environment.db
    found = {}
    with store.environment.read() as txn:
        for key, value in txn.cursor(db=db["shared"]):
            count = txn.get(key, db=db["shared_refs"])
            found[bytes(key[4:])] = (int.from_bytes(count, "little") if count else 0, bytes(value))
    return found


def prefix(store: Store) -> bytes:
    return layout.table_prefix(store.catalog.lookup("t")[0])


def stored_sizes(store: Store, uids: list[str]) -> list[int]:
    db = store.environment.db
    with store.environment.read() as txn:
        return [len(txn.get(prefix(store) + uid.encode(), db=db["blobs"])) for uid in uids]


def test_a_groups_prompt_is_stored_once_and_every_read_returns_the_runs_whole(store: Store) -> None:
    group = items(*(run(0, index) for index in range(4)))
    store.put("t", group)
    prompt = group[0].tensors["tokens"].data[: PROMPT * 8]
    assert shared(store) == {digests.of(prompt): (4, bytes(prompt))}
    payloads = [trxp.pack_item(item) for item in group]
    sizes = stored_sizes(store, [item.uid for item in group])
    assert all(
        size < len(payload) - PROMPT * 8 + 64 for size, payload in zip(sizes, payloads, strict=True)
    )  # the prompt's bytes are not in the run's value
    got = store.get("t", [item.uid for item in group])
    assert [got[item.uid] for item in group] == payloads
    batch = take(store, "t", num_groups=1, delivery="lease", lease_seconds=60)
    assert trxp.parse(batch.payload) == whole(group)


def test_runs_with_other_prompts_or_short_ones_are_stored_on_their_own(store: Store) -> None:
    store.put("t", items(run(0, 0), run(0, 1), run(1, 0), run(2, 0, prompt=8)))
    counts = sorted(count for count, _ in shared(store).values())
    assert counts == [1, 2]  # task 0's prompt twice, task 1's once; task 2's 64 bytes stay with it
    short = run(2, 0, prompt=8)
    assert stored_sizes(store, [f"{short.eid.uid}"]) == [len(trxp.pack_item(trxp.from_experience(short)))]


def test_a_prompt_is_shared_across_groups_and_counted_once_a_run(store: Store) -> None:
    """The same task in two batches: its prompt is kept once; a retried push counts nothing."""
    first = items(*(run(0, index) for index in range(4)))
    again = [
        trxp.from_experience(Experience(**{**exp.__dict__, "eid": EID(batch=1, task=0, run=exp.eid.run, suffix="x")}))
        for exp in (run(0, index) for index in range(2))
    ]
    store.put("t", first)
    store.put("t", first[:2])  # duplicates
    store.put("t", again)
    assert [count for count, _ in shared(store).values()] == [6]


@pytest.mark.parametrize("how", ["consume", "delete", "evict", "drop"])
def test_the_prompt_goes_with_its_last_run(tmp_path: Path, how: str) -> None:
    when_full = "evict" if how == "evict" else "block"
    config = TableConfig.of(name="t", estimator="none", group_size=2, capacity_experiences=4, when_full=when_full)
    with Store(tmp_path / "data", map_size=64 << 20, seed=3) as store:
        store.create_table(config)
        store.put("t", items(run(0, 0), run(0, 1), run(1, 0), run(1, 1)))
        assert len(shared(store)) == 2
        if how == "consume":
            take(store, "t", num_groups=1, delivery="consume")
        elif how == "delete":
            store.delete("t", group_ids=[run(0, 0).eid.tid])
        elif how == "evict":
            store.put("t", items(run(2, 0), run(2, 1)))
        else:
            store.drop_table("t")
            assert shared(store) == {}
            return
        assert sorted(count for count, _ in shared(store).values()) == [2, 2] if how == "evict" else [2]
        assert store.verify("t") == []
        store.delete("t", group_ids=[exp.eid.tid for exp in (run(0, 0), run(1, 0), run(2, 0))])
        assert shared(store) == {}
        assert store.verify("t") == []


@pytest.mark.parametrize("layout", ["rows", "records"])
def test_stale_runs_dropped_inside_a_takes_own_transaction_release_their_prompts_only_if_it_is_kept(
    tmp_path: Path, layout: str
) -> None:
    """A take that moves the trainer's version drops the stale groups in a transaction of its own,
    nested in the writer's, and their payloads' deletes read the references in one nested in that:
    kept with a batch, the prompts go with their runs; undone with a take that fills nothing, every
    count stands as it was."""
    made = TableConfig.of(name="t", estimator="none", group_size=2, max_staleness=0, evict_stale=True)
    config = dataclasses.replace(made, storage=dataclasses.replace(made.storage, layout=layout))

    def versioned(task: int, version: int) -> list[trxp.RawItem]:
        return [
            trxp.from_experience(Experience(**{**exp.__dict__, "info": {"model_version": version}}))
            for exp in (run(task, 0), run(task, 1))
        ]

    with Store(tmp_path / "data", map_size=64 << 20, seed=3) as store:
        store.create_table(config)
        store.set_trainer_version("t", 0)
        for task, version in ((0, 0), (1, 0), (2, 1)):
            store.put("t", versioned(task, version))
        before = shared(store)
        assert sorted(count for count, _ in before.values()) == [2, 2, 2]
        assert take(store, "t", num_groups=2, trainer_version=1, wait_seconds=0) is None  # two stale, one fresh
        assert shared(store) == before and store.stats("t")["dropped_stale"] == 0
        batch = take(store, "t", num_groups=1, trainer_version=1, delivery="consume")
        assert batch is not None and batch.versions == [1, 1]
        assert shared(store) == {} and store.stats("t")["dropped_stale"] == 2
        assert store.verify("t") == []


def test_a_damaged_shared_prompt_is_found_by_each_run_and_quarantines_them(store: Store) -> None:
    group = items(*(run(0, index) for index in range(4)))
    store.put("t", group)
    (digest,) = shared(store)
    env, db = store.environment, store.environment.db
    key = prefix(store) + digest
    with env.env.begin(write=True) as txn:
        value = bytearray(txn.get(key, db=db["shared"]))
        value[100] ^= 1
        txn.put(key, bytes(value), db=db["shared"])
    assert store.get("t", [item.uid for item in group]) == {}  # each found damaged, none served
    assert shared(store) == {}  # the quarantined runs released it
    assert store.stats("t")["quarantined"] == 4


def test_a_run_whose_prompt_digest_names_other_bytes_is_stored_whole(store: Store) -> None:
    """Bytes are compared, not digests trusted: other bytes kept under the prompt's digest (as a
    collision would) leave the run whole, its read intact."""
    exp = run(0, 0)
    (item,) = items(exp)
    prompt = bytes(item.tensors["tokens"].data[: PROMPT * 8])
    key = prefix(store) + digests.of(prompt)
    db = store.environment.db
    with store.environment.env.begin(write=True) as txn:
        txn.put(key, b"\0" * len(prompt), db=db["shared"])
        txn.put(key, (1).to_bytes(8, "little"), db=db["shared_refs"])
    store.put("t", [item])
    assert stored_sizes(store, [item.uid]) == [len(trxp.pack_item(item))]
    assert store.get("t", [item.uid]) == {item.uid: trxp.pack_item(item)}
    assert any("no stored run refers to" in problem for problem in store.verify("t"))
    with store.environment.env.begin(write=True) as txn:
        txn.delete(key, db=db["shared"])
        txn.delete(key, db=db["shared_refs"])


def test_verify_finds_a_miscounted_or_missing_prompt(store: Store) -> None:
    store.put("t", items(run(0, 0), run(0, 1)))
    (digest,) = shared(store)
    key = prefix(store) + digest
    db = store.environment.db
    env: lmdb.Environment = store.environment.env
    with env.begin(write=True) as txn:
        txn.put(key, (5).to_bytes(8, "little"), db=db["shared_refs"])
    assert any("counted otherwise" in problem for problem in store.verify("t"))
    with env.begin(write=True) as txn:
        txn.put(key, (2).to_bytes(8, "little"), db=db["shared_refs"])
        prompt = txn.pop(key, db=db["shared"])
    assert any("are missing" in problem for problem in store.verify("t"))
    with env.begin(write=True) as txn:
        txn.put(key, prompt, db=db["shared"])


def test_runs_read_back_after_a_restart(tmp_path: Path) -> None:
    group = items(*(run(0, index) for index in range(4)))
    config = TableConfig.of(name="t", estimator="none", group_size=4)
    with Store(tmp_path / "data", map_size=64 << 20) as store:
        store.create_table(config)
        store.put("t", group)
    with Store(tmp_path / "data", map_size=64 << 20) as store:
        got = store.get("t", [item.uid for item in group])
        assert [got[item.uid] for item in group] == [trxp.pack_item(item) for item in group]
        assert store.verify("t") == []


def test_a_prefix_and_branches_batch_rebuilds_each_runs_tokens(client: BufferClient) -> None:
    """Through a real server: two groups sharing their prompts, one whose runs each have their own,
    and short prompts stored whole. Sampled (and read) as prefix + branches, each distinct prompt
    comes once and each run's tokens are its prefix then its branch, exactly as pushed; the
    columnar tokens and the TRXP payload are the runs as pushed too."""
    client.create_table("tree", group_size=3, estimator="none")
    made = [run(task, index) for task in range(2) for index in range(3)]
    made += [run(2, index, seed=index + 1) for index in range(3)]  # a prompt of its own each
    made += [run(3, index, prompt=5) for index in range(3)]
    client.push(trxp.encode(made), table="tree")
    fields = ["prefix_tokens", "branch_tokens", "prefix_of", "tokens"]
    (batch,) = client.sample("tree", num_groups=4, delivery="lease", lease_seconds=60, max_batches=1, fields=fields)
    by_uid = {exp.eid.uid: exp for exp in made}
    tree = batch.prefix_branches()
    assert tree.items == list(range(len(made)))
    assert len(tree.prefixes) == 2 + 3 + 1
    for k, position in enumerate(tree.items):
        exp = by_uid[batch.uids[position]]
        assert torch.equal(tree.tokens(k), exp.tokens)
        assert torch.equal(tree.prefixes[tree.prefix_of[k]], exp.tokens[: exp.prompt_length])
        assert torch.equal(batch.columns["tokens"].tensors[k], exp.tokens)
    read = client.read_fields(batch.uids, fields[:3], table="tree").prefix_branches()
    assert [torch.equal(read.tokens(k), tree.tokens(k)) for k in range(len(made))] == [True] * len(made)
    got = client.get(batch.uids, table="tree")
    assert [torch.equal(exp.tokens, by_uid[exp.eid.uid].tokens) for exp in got] == [True] * len(made)
    batch.ack()


def test_prefix_fields_with_shares_are_refused_by_name(client: BufferClient) -> None:
    client.create_table("cut", group_size=1, estimator="none")
    client.push(trxp.encode([run(0, 0)]), table="cut")
    with pytest.raises(InvalidArgumentError, match="prefix_tokens read whole prompts"):
        client.read_fields([run(0, 0).eid.uid], ["prefix_tokens"], table="cut", share=0, of=2)
    assert len(client.get([run(0, 0).eid.uid], table="cut")) == 1  # the server serves on


def test_a_format_6_directory_upgrades_its_runs_stay_whole_and_new_pushes_share(tmp_path: Path) -> None:
    """A directory of the format before shared prompts (its runs stored whole, no shared
    databases): the open brings it to the current format in place; its runs read back as stored and are
    never counted; runs pushed from then on share their prompt."""
    old = items(run(0, 0), run(0, 1))
    config = TableConfig.of(name="t", estimator="none", group_size=4)
    with Store(tmp_path / "data", map_size=64 << 20) as store:
        store.create_table(config)
        store.put("t", old)
        env, db = store.environment.env, store.environment.db
        with env.begin(write=True) as txn:
            for name in ("shared", "shared_refs"):
                txn.delete(next(iter(txn.cursor(db=db[name])))[0], db=db[name])
            for item in old:  # as format 6 stored them: whole
                txn.put(prefix(store) + item.uid.encode(), trxp.pack_item(item), db=db["blobs"])
            txn.put(b"format", b"6", db=db["meta"])
        with env.begin(write=True) as txn:
            for name in ("shared", "shared_refs"):
                txn.drop(env.open_db(name.encode(), txn=txn), delete=True)
    with Store(tmp_path / "data", map_size=64 << 20) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.environment.db["meta"]) == str(layout.FORMAT).encode()
        assert shared(store) == {}
        assert stored_sizes(store, [item.uid for item in old]) == [len(trxp.pack_item(item)) for item in old]
        new = items(run(0, 2), run(0, 3))
        store.put("t", new)
        assert [count for count, _ in shared(store).values()] == [2]
        got = store.get("t", [item.uid for item in old + new])
        assert [got[item.uid] for item in old + new] == [trxp.pack_item(item) for item in old + new]
        assert store.verify("t") == []


def test_the_metrics_show_the_shared_prompts(server: ExpbufServer, client: BufferClient) -> None:
    """An operator sees how many prompts are kept once, and their bytes, in a real scrape."""
    client.create_table("seen", group_size=4, estimator="none")
    before = scrape(server.metrics_port)
    assert before[("expbuf_shared_prompts", ())] == 0
    client.push(trxp.encode([run(task, index) for task in range(2) for index in range(4)]), table="seen")
    after = scrape(server.metrics_port)
    assert after[("expbuf_shared_prompts", ())] == 2
    assert after[("expbuf_shared_prompt_bytes", ())] >= 2 * PROMPT * 8  # two 4 KiB prompts, once each


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint16, torch.float32])
def test_the_prompt_bytes_an_entry_carries_are_the_span_the_writer_would_find(dtype: torch.dtype) -> None:
    """The writer shares a prompt only where Entry.prompt_bytes reaches MIN_BYTES, without reading
    the payload's header: for every prompt length about the threshold, the span the header gives
    (shared_prompts._prompt_span) is there exactly then, and as long."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    threshold = shared_prompts.MIN_BYTES // itemsize
    for prompt in (0, 1, threshold - 1, threshold, threshold + 1, 3 * threshold):
        exp = Experience(
            eid=EID(task=prompt, run=0, suffix="s"),
            tokens=torch.arange(prompt + 5).to(dtype),
            prompt_length=prompt,
            logprobs=torch.zeros(5),
        )
        (entry,) = [Entry.of(item) for item in items(exp)]
        span = shared_prompts._prompt_span(entry.blob, entry.response_length)
        assert entry.prompt_bytes == prompt * itemsize
        assert (span is not None) == (entry.prompt_bytes >= shared_prompts.MIN_BYTES), prompt
        assert span is None or span[1] - span[0] == entry.prompt_bytes


@pytest.mark.parametrize(("at", "what"), [(6, "its prompt's digest"), (1, "its magic")])
def test_a_run_whose_reference_is_damaged_leaves_its_prompt_which_expbuf_repair_drops(
    tmp_path: Path, at: int, what: str
) -> None:
    """A run quarantined with `what` damaged in its reference released another prompt's count (or,
    its magic gone, none): its own prompt was kept for good once its group went, and `expbuf check`
    failed on it from then on with nothing to mend it. `expbuf repair` counts each prompt again as
    the stored runs refer to it and drops those none does."""
    data = tmp_path / "data"
    with Store(data, map_size=64 << 20, seed=3) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=4))
        group = items(*(run(0, index) for index in range(4)))
        store.put("t", group)
        key, db = prefix(store) + group[1].uid.encode(), store.environment.db["blobs"]
        with store.environment.env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=db))
            value[at] ^= 1
            txn.put(key, bytes(value), db=db)
        assert group[1].uid not in store.get("t", [item.uid for item in group])  # found damaged: quarantined
        store.delete("t", group_ids=["0/0"])  # the rest of its group goes
        assert any("no stored run refers to" in problem for problem in store.verify("t")), what
    done = cli_forks.run("repair", "--data", str(data), timeout=120)
    assert done.returncode == 0 and "t: counted 1 shared prompt(s) again" in done.stdout, done
    with Store(data, map_size=64 << 20) as store:
        assert shared(store) == {} and store.verify("t") == []
