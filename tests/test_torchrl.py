"""expbuf.client.torchrl driven by TorchRL's own classes: ReplayBuffer, MCAdvantage, LLMCollector, GRPOLoss.

Every test runs a real server in-process (tests/conftest.py). The data are TorchRL's LLM
TensorDicts: its Tokens, Masks, LogProbs and Text classes, the group name at "query" (as its
datasets and MCAdvantage name it) and the reward at ("next", "reward") in the (1, 1) shape its
reward parsers give. The LLM path runs on the CPU with a one-layer Llama built from a config
and a tokenizer built in the test (nothing downloaded): ChatEnv in text mode, TorchRL's
TransformersWrapper generating, LLMCollector writing into the expbuf storage, and GRPOLoss
(with a TransformersWrapper scoring) on the sampled batch. The line: TorchRL's vLLM and SGLang
wrappers and its Ray collectors need CUDA and are not run; nothing else of the path is left out.
"""

from __future__ import annotations

import gc
import pickle
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from expbuf.client import EID, BufferClient, DeadlineExceededError, Experience, layout

from helpers import ServerProcess, passes_started
from pages import code_blocks, page


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global torchrl, TensorDict, TensorDictBase, lazy_stack, set_list_to_stack, ReplayBuffer
    global TensorDictMaxValueWriter, TensorDictReplayBuffer, LogProbs, Masks, Text, Tokens, MCAdvantage
    global ExpbufSampler, ExpbufStorage, from_areal, to_element
    torchrl = pytest.importorskip("torchrl")
    from tensordict import TensorDict, TensorDictBase, lazy_stack, set_list_to_stack
    from torchrl.data import ReplayBuffer, TensorDictMaxValueWriter, TensorDictReplayBuffer
    from torchrl.modules.llm.policies import LogProbs, Masks, Text, Tokens
    from torchrl.objectives.llm import MCAdvantage

    from expbuf.client.areal.convert import from_areal
    from expbuf.client.torchrl import ExpbufSampler, ExpbufStorage
    from expbuf.client.torchrl.convert import to_element


PROMPT = torch.tensor([5, 6, 7])


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> type:
    """The TorchRL replay buffer class a test's parameter names: its classes are imported as the
    module's tests start (import_frameworks), after pytest has collected the parameters."""
    return {"ReplayBuffer": ReplayBuffer, "TensorDictReplayBuffer": TensorDictReplayBuffer}[request.param]


@pytest.fixture(autouse=True)
def _stack_lists() -> Iterator[None]:
    """TorchRL's LLM stack runs with lists stacked (its GRPO scripts and tests set it)."""
    with set_list_to_stack(True):
        yield


def element(query: str, run: int, reward: float, *, version: int | None = None) -> TensorDict:
    """One dialog turn as TorchRL's LLM wrappers and envs write it (unpadded, done)."""
    response = torch.arange(2 + run % 3) + 10 * (run + 1)
    full = torch.cat([PROMPT, response])
    assistant = torch.cat([torch.zeros(3, dtype=torch.bool), torch.ones(len(response), dtype=torch.bool)])
    assistant[-1] = run % 2 == 0  # a masked-out last token on odd runs: masks keep their zeros
    fields: dict = {
        "tokens": Tokens(prompt=PROMPT, response=response, full=full, padded=False, batch_size=[]),
        "masks": Masks(
            all_attention_mask=torch.ones(len(full), dtype=torch.bool),
            all_assistant_mask=assistant,
            padded=False,
            batch_size=[],
        ),
        "log_probs": LogProbs(response=-torch.rand(len(response)) - 0.1, padded=False, batch_size=[]),
        "text": Text(prompt=f"<q>{query}", response=f"answer {run}", batch_size=[]),
        "query": query,
        ("next", "reward"): torch.tensor([[reward]]),
        ("next", "done"): torch.tensor([True]),
    }
    if version is not None:
        fields["policy_version"] = version
    return TensorDict(fields, batch_size=[])


def groups(queries: list[str], size: int, offset: float = 0.0) -> TensorDictBase:
    """`size` runs of each query, with distinct rewards, lazily stacked as LLMCollector flattens them."""
    return lazy_stack(
        [element(q, run, offset + (run * run + 1.0) * (i + 1)) for i, q in enumerate(queries) for run in range(size)]
    )


def buffer(target: str, table: str, batch_size: int, **options) -> ReplayBuffer:
    return ReplayBuffer(
        storage=ExpbufStorage(target, table), sampler=ExpbufSampler(timeout=5, **options), batch_size=batch_size
    )


def key(td: TensorDictBase) -> tuple[str, tuple[int, ...]]:
    """An element's identity in these tests: its group name and its response."""
    return td["query"], tuple(td["tokens", "response"].tolist())


def rows(batch: TensorDictBase) -> list[TensorDictBase]:
    return list(batch.unbind(0))


def uids_of(batch: TensorDictBase) -> list[str]:
    return list(batch["expbuf", "uid"])


def test_extend_and_sample_whole_groups_with_the_tables_advantage_equal_to_mcadvantage(target) -> None:
    with BufferClient(target) as admin:
        admin.create_table("grpo4", group_size=4, estimator="grpo")
        data = groups(["alpha", "beta", "gamma", "delta"], 4)
        rb = buffer(target, "grpo4", 8)
        rb.extend(data)
        assert len(rb) == 16  # ready in the table: complete groups
        reference = MCAdvantage(grpo_size=4, prompt_key="query").inv(data.clone())
        mc = {key(td): float(td["advantage"].reshape(())) for td in rows(reference)}
        seen: list[str] = []
        for _ in range(2):
            batch = rb.sample()
            uids = uids_of(batch)
            assert batch["advantage"].shape == (len(uids), 1, 1)
            assert Counter(batch["expbuf", "group_id"]).most_common()[-1][1] == 4  # whole groups only
            stored = {e.eid.uid: e for e in admin.get(uids, "grpo4")}
            for uid, td in zip(uids, rows(batch), strict=True):
                exp = stored[uid]
                first_action = exp.advantages[exp.action_mask.bool()][0]
                assert float(td["advantage"].reshape(())) == pytest.approx(float(first_action), abs=0)  # the table's
                # TorchRL's MCAdvantage: (r - mean) / max(std, 1e-6); grpo: (r - mean) / (std + 1e-6)
                assert float(td["advantage"].reshape(())) == pytest.approx(mc[key(td)], rel=1e-5)
            seen += [td["query"] for td in rows(batch)]
        assert Counter(seen) == {"alpha": 4, "beta": 4, "gamma": 4, "delta": 4}


def test_an_experience_with_no_generated_token_has_the_tables_advantage_as_mcadvantage_gives_it(target) -> None:
    """A run whose response is empty (or masked out whole) had advantage 0: it was read from the
    per-token values under the mask, of which it has none, where TorchRL's MCAdvantage gives it its
    group's (r - mean) / std (a helper's audit). The server's one value an experience is used."""
    with BufferClient(target) as admin:
        admin.create_table("empty", group_size=3, estimator="grpo")
    sent = [element("q", run, float(run == 0)) for run in range(3)]
    for name in ("response", "full"):
        sent[0]["tokens", name] = sent[0]["tokens", name][: len(PROMPT) if name == "full" else 0]
    sent[0]["masks", "all_assistant_mask"] = sent[0]["masks", "all_assistant_mask"][: len(PROMPT)]
    sent[0]["masks", "all_attention_mask"] = sent[0]["masks", "all_attention_mask"][: len(PROMPT)]
    sent[0]["log_probs", "response"] = sent[0]["log_probs", "response"][:0]
    data = lazy_stack(sent)
    reference = MCAdvantage(grpo_size=3, prompt_key="query").inv(data.clone())
    mc = {key(td): float(td["advantage"].reshape(())) for td in rows(reference)}
    rb = buffer(target, "empty", 3)
    rb.extend(data)
    got = {key(td): float(td["advantage"].reshape(())) for td in rows(rb.sample())}
    assert got == pytest.approx(mc, rel=1e-5) and got[("q", ())] > 1


def test_a_sampled_element_holds_what_was_extended_under_torchrls_keys(target) -> None:
    with BufferClient(target) as admin:
        admin.create_table("keys", group_size=2, estimator="grpo")
    sent = lazy_stack([element("q", run, float(run), version=7) for run in range(2)])
    rb = buffer(target, "keys", 2)
    rb.extend(sent)
    got = {key(td): td for td in rows(rb.sample())}
    for td in rows(sent):
        back = got[key(td)]
        for name in [("tokens", "prompt"), ("tokens", "full"), ("log_probs", "response")]:
            assert torch.equal(back[name], td[name]), name
        assert torch.equal(back["masks", "all_assistant_mask"], td["masks", "all_assistant_mask"])
        assert bool(back["masks", "all_attention_mask"].all())
        assert (back["text", "prompt"], back["text", "response"]) == (td["text", "prompt"], td["text", "response"])
        assert torch.equal(back["next", "reward"], td["next", "reward"])
        assert int(back["policy_version"]) == 7
        full = back["log_probs", "full"]
        assert bool(full[:3].isnan().all()) and torch.equal(full[3:], td["log_probs", "response"])


def test_a_group_named_by_a_tensor_comes_back_in_its_dtype_and_shape(target) -> None:
    """A group id tensor (an int32 of shape (1,)) came back an int64 of shape (): trainer code that
    stacks or indexes `td["query"]` saw another tensor (a helper's audit)."""
    with BufferClient(target) as admin:
        admin.create_table("ids", group_size=2, estimator="grpo")
    sent = [element("q", run, float(run)) for run in range(4)]
    ids = [torch.tensor([7], dtype=torch.int32), torch.tensor([[2**40]])]
    for at, td in enumerate(sent):
        td["query"] = ids[at // 2]
    rb = buffer(target, "ids", 4)
    rb.extend(lazy_stack(sent))
    back = [td["query"] for td in rows(rb.sample())]
    assert sorted((str(q.dtype), tuple(q.shape), q.reshape(-1).tolist()) for q in back) == [
        ("torch.int32", (1,), [7]), ("torch.int32", (1,), [7]),
        ("torch.int64", (1, 1), [2**40]), ("torch.int64", (1, 1), [2**40]),
    ]  # fmt: skip


def test_log_probs_and_a_reward_come_back_in_the_dtype_and_shape_they_were_extended_in(target) -> None:
    """float64 log-probs came back float32 (-0.1234567890123 as -0.12345679104), and a float64
    reward, or one of another shape, came back float32 of shape (1, 1), where TorchRL's own storages
    give back what they were given (a helper's audit)."""
    with BufferClient(target) as admin:
        admin.create_table("dtypes", group_size=2, estimator="grpo")
    sent = [element("q", run, 0.0) for run in range(2)]
    sent[0]["log_probs", "response"] = sent[0]["log_probs", "response"].double() - 1e-12
    sent[0]["next", "reward"] = torch.tensor([0.1234567890123], dtype=torch.float64)
    sent[1]["next", "reward"] = torch.tensor([[1.0]], dtype=torch.float32)  # TorchRL's own form
    rb = buffer(target, "dtypes", 2)
    rb.extend(lazy_stack(sent))
    got = {key(td): td for td in rows(rb.sample())}
    for td in sent:
        back = got[key(td)]
        assert back["log_probs", "response"].dtype == td["log_probs", "response"].dtype
        assert torch.equal(back["log_probs", "response"], td["log_probs", "response"])
        assert back["log_probs", "full"].dtype == td["log_probs", "response"].dtype
        assert back["next", "reward"].dtype == td["next", "reward"].dtype
        assert torch.equal(back["next", "reward"], td["next", "reward"])


def runs_by_group(admin: BufferClient, table: str) -> dict[str, list[tuple[str, int]]]:
    """Each group's members as (suffix, run), in the order they were written: a storage's suffix is
    an `ordered_id`, whose text sorts in the order the writer made it."""
    listed = admin.list_experiences(table, limit=1000).experiences
    members: dict[str, list[tuple[str, int]]] = {}
    for exp in admin.get([e.uid for e in listed], table):
        members.setdefault(exp.eid.tid, []).append((exp.eid.suffix, int(exp.eid.run)))
    return {tid: sorted(got) for tid, got in members.items()}


def test_each_member_of_a_group_has_its_own_run_in_the_order_written(target) -> None:
    """A group's members get runs 0 .. group_size - 1 in the order they are written, as the other
    adapters number a group's runs (AReaL's workflow, TRL's worker): an extend of whole groups,
    one past a group, `add` one at a time, and a writer's push into a round another writer filled,
    refused and made again one member at a time (its members then the next round's runs from 0).
    Every member was run 0, so a group's runs were not told apart: an estimator over runs
    (step_wise_grpo) took the whole group for one run."""
    with BufferClient(target) as admin:
        admin.create_table("runs", group_size=4, estimator="grpo")
        rb = buffer(target, "runs", 4)
        data = groups(["a", "b"], 4)
        rb.extend(data)
        pushed = {key(td): int(td["tokens", "response"][0]) // 10 - 1 for td in rows(data)}  # element()'s run
        for exp in admin.get([e.uid for e in admin.list_experiences("runs").experiences], "runs"):
            element = (exp.info["group"], tuple(layout.split(exp.tokens, exp.prompt_length)[1].tolist()))
            assert exp.eid.run == pushed[element], (exp.eid.uid, element)  # the element written run-th
        rb.extend(groups(["c"], 6))  # c's round 0, and two into its round 1
        for td in rows(groups(["c"], 2, offset=1.0)):
            rb.add(td)  # c's round 1 filled one at a time
        late = ReplayBuffer(storage=ExpbufStorage(target, "runs"))  # knows nothing: its push into round 0
        late.extend(groups(["a"], 4, offset=2.0))  # is refused, and made again one at a time: round 1
        late.storage.close()
        members = runs_by_group(admin, "runs")
        assert len(members) == 5
        for tid, got in members.items():
            assert [run for _, run in got] == [0, 1, 2, 3], (tid, got)
        assert admin.stats("runs")["runs"].pushed == 20  # nothing stored twice
        admin.create_table("each", group_size=0, estimator="grpo")  # a push's members of a name: one group
        rb = buffer(target, "each", 3)
        rb.extend(groups(["a", "b"], 3))
        rb.extend(groups(["a"], 2))
        assert sorted([run for _, run in got] for got in runs_by_group(admin, "each").values()) == [
            [0, 1],
            [0, 1, 2],
            [0, 1, 2],
        ]


def test_an_estimator_over_runs_takes_each_member_for_a_run_of_its_own(target) -> None:
    """step_wise_grpo is grpo over each run's last step: a group of single-turn elements, each its
    own run, gets MCAdvantage's values, as grpo gives them (not one value for the whole group)."""
    with BufferClient(target) as admin:
        admin.create_table("steps", group_size=4, estimator="step_wise_grpo")
    data = groups(["alpha", "beta"], 4)
    rb = buffer(target, "steps", 8)
    rb.extend(data)
    reference = MCAdvantage(grpo_size=4, prompt_key="query").inv(data.clone())
    mc = {key(td): float(td["advantage"].reshape(())) for td in rows(reference)}
    got = {key(td): float(td["advantage"].reshape(())) for td in rows(rb.sample())}
    assert got.keys() == mc.keys()
    for name, value in got.items():
        assert value == pytest.approx(mc[name], rel=1e-5), name


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_token_ids_come_back_as_torch_long_whatever_dtype_they_were_pushed_in(target, dtype) -> None:
    """AReaL's rows keep their input_ids' dtype (int32 where its padding made them so), and expbuf
    stores a tensor's dtype: TorchRL's LLM wrappers and losses index embeddings and gather
    log-probs with token ids, which they take as torch.long, as every other source gives them.
    A sampled batch's token ids are torch.long whatever dtype they were pushed in."""
    with BufferClient(target) as admin:
        admin.create_table("dtypes", group_size=2, estimator="grpo")
        input_ids = torch.tensor([[5, 6, 7, 40, 41, 0], [5, 6, 7, 50, 51, 52]], dtype=dtype)
        areal = {
            "input_ids": input_ids,
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.int32),
            "rewards": torch.tensor([0.0, 1.0]),
        }
        exps = from_areal(areal, [EID(batch=0, task="t", run=run) for run in range(2)])
        assert {exp.tokens.dtype for exp in exps} == {dtype}
        admin.push(exps, "dtypes")
        assert {exp.tokens.dtype for exp in admin.get([exp.eid.uid for exp in exps], "dtypes")} == {dtype}
    batch = buffer(target, "dtypes", 2).sample()
    for td in rows(batch):
        for part in ("prompt", "response", "full"):
            assert td["tokens", part].dtype == torch.long, (part, td["tokens", part].dtype)
    assert sorted(tuple(td["tokens", "response"].tolist()) for td in rows(batch)) == [(40, 41), (50, 51, 52)]


def test_token_ids_stored_as_torch_long_are_not_copied() -> None:
    """Tokens already torch.long are the experience's own tensor in the element (zero copy)."""
    exp = Experience(eid=EID(batch=0, task="t"), tokens=torch.arange(6), prompt_length=3, reward=1.0)
    element = to_element(exp, "query")
    assert element["tokens", "full"].data_ptr() == exp.tokens.data_ptr()
    assert element["tokens", "response"].data_ptr() == exp.tokens[3:].data_ptr()


def test_a_drawn_batchs_elements_are_made_without_the_collectors_passes(target) -> None:
    """The storage makes a drawn batch's TensorDicts (convert.to_element) with the collector's passes
    held off, as a batch is decoded: none starts inside, where at this threshold dozens would."""
    with BufferClient(target) as admin:
        admin.create_table("made", group_size=2, estimator="grpo")
    rb = buffer(target, "made", 128)
    rb.extend(groups([f"q{i}" for i in range(64)], 2))
    with passes_started(inside="to_element") as inside:
        batch = rb.sample()
    assert len(rows(batch)) == 128 and gc.isenabled()
    assert inside and not any(inside)  # passes ran (the threshold is low), none inside the making


def test_a_tensordict_replay_buffer_takes_them_too(target) -> None:
    """TensorDictReplayBuffer writes the sampler's info into the batch: it holds tensors only."""
    with BufferClient(target) as admin:
        admin.create_table("tdrb", group_size=2, estimator="grpo")
        rb = TensorDictReplayBuffer(
            storage=ExpbufStorage(target, "tdrb"), sampler=ExpbufSampler(timeout=5), batch_size=2
        )
        rb.extend(groups(["a"], 2))
        batch = rb.sample()
        assert batch["times_sampled"].tolist() == [1, 1]
        assert sorted(batch["advantage"].flatten().tolist()) == pytest.approx([-0.70710677, 0.70710677], rel=1e-5)
        rb.sampler.ack()
        assert admin.stats("tdrb")["tdrb"].consumed == 2


@pytest.mark.parametrize("kind", ["ReplayBuffer", "TensorDictReplayBuffer"], indirect=True)
def test_iterating_ends_when_no_batch_comes_within_the_wait(target, kind) -> None:
    """`for batch in rb:` runs until the sampler's `ran_out` (TorchRL's ReplayBuffer.__iter__):
    it is set when no batch comes within `timeout` after the last one, so the loop ends there,
    having acknowledged every batch it yielded. A loop's first batch is `rb.sample()`'s: none
    within the wait raises DeadlineExceededError, as `rb.sample()` does."""
    with BufferClient(target) as admin:
        admin.create_table("iter", group_size=2, estimator="grpo")
        rb = kind(storage=ExpbufStorage(target, "iter"), sampler=ExpbufSampler(timeout=1), batch_size=2)
        rb.extend(groups(["a", "b", "c"], 2))
        seen = [td["query"] for batch in rb for td in rows(batch)]
        assert Counter(seen) == {"a": 2, "b": 2, "c": 2}
        table = admin.stats("iter")["iter"]
        assert (table.consumed, table.leased, table.ready) == (6, 0, 0)
        with pytest.raises(DeadlineExceededError, match="did not have 2 experiences ready within 1s"):
            rb.sample()
        with pytest.raises(DeadlineExceededError):
            next(iter(rb))
        rb.extend(groups(["d"], 2))  # more data: a loop runs again
        assert [td["query"] for batch in rb for td in rows(batch)] == ["d", "d"]
        assert admin.stats("iter")["iter"].consumed == 8


def test_one_element_at_a_time_makes_the_same_groups_and_a_prompt_seen_again_a_new_group(target) -> None:
    """MCAdvantage's grouping, kept by the table: the first four of a name are its group 0, the
    next four its group 1; `add` (one element) counts as extend does."""
    with BufferClient(target) as admin:
        admin.create_table("rounds", group_size=4, estimator="grpo")
        rb = buffer(target, "rounds", 4)
        for td in rows(groups(["same"], 8)):
            rb.add(td)
        table = admin.stats("rounds")["rounds"]
        assert (table.ready, table.groups_ready, table.groups_pending) == (8, 2, 0)
        first, second = set(rb.sample()["expbuf", "group_id"]), set(rb.sample()["expbuf", "group_id"])
        assert len(first) == len(second) == 1 and first != second
        rb.extend(groups(["other"], 6))  # one extend past a group: four make group 0, two open group 1
        rb.extend(groups(["other"], 2, offset=1.0))
        table = admin.stats("rounds")["rounds"]
        assert (table.ready, table.groups_ready, table.groups_pending) == (8, 2, 0)


def test_writers_on_their_own_fill_one_group_and_a_new_writer_finds_the_open_round(target) -> None:
    """Two processes' storages (pickled, as a collector's would be) each write half of a group:
    the group completes on the server, which MCAdvantage's per-process queues cannot do. A writer
    that starts later, knowing nothing, passes the rounds other writers filled."""
    with BufferClient(target) as admin:
        admin.create_table("shared", group_size=4, estimator="grpo")
        storage = ExpbufStorage(target, "shared")
        writers = [pickle.loads(pickle.dumps(storage)) for _ in range(3)]
        data = rows(groups(["p"], 4))
        writers[0].set(None, lazy_stack(data[:2]))
        assert admin.stats("shared")["shared"].groups_pending == 1
        writers[1].set(None, lazy_stack(data[2:]))
        assert admin.stats("shared")["shared"].groups_ready == 1
        writers[0].set(None, lazy_stack(data[:3]))  # round 1, three of four
        writers[2].set(None, lazy_stack(rows(groups(["p"], 2, offset=5.0))))  # passes round 0: one into 1, one into 2
        table = admin.stats("shared")["shared"]
        assert (table.groups_ready, table.groups_pending, table.ready, table.pending) == (2, 1, 8, 1)


def test_a_batch_is_leased_until_the_next_sample_and_a_dead_trainers_batch_comes_back(target) -> None:
    with BufferClient(target) as admin:
        admin.create_table("lease", group_size=2, estimator="grpo")
        rb = buffer(target, "lease", 2, lease_seconds=1.0)
        rb.extend(groups(["a", "b", "c"], 2))

        def counts() -> tuple[int, int, int]:
            table = admin.stats("lease")["lease"]
            return table.ready, table.leased, table.consumed

        first = uids_of(rb.sample())
        assert counts() == (4, 2, 0)
        rb.sample()  # the step that used the first batch returned: it is acknowledged
        assert counts() == (2, 2, 2)
        # a trainer that dies: nothing acknowledges its batch, nothing renews its lease
        dead = buffer(target, "lease", 2, lease_seconds=1.0)
        taken = uids_of(dead.sample())
        dead.sampler._keeper.close()  # as its process's death would: nothing renews the lease
        assert counts() == (0, 4, 2)
        again = uids_of(rb.sample())  # acknowledges the second batch, waits for the dead one's
        assert set(again) == set(taken) and not set(again) & set(first)
        rb.sampler.ack()  # after the last step
        assert counts() == (0, 0, 6)


@pytest.mark.parametrize("reconnect", ["close", "load_state_dict"])
def test_a_storage_closed_or_pointed_again_samples_on_and_acknowledges_the_step_before(target, reconnect) -> None:
    """`storage.close()` between phases, or a state dict naming the same table at another address of
    the server: the storage opens its client again on use, but the sampler's lease keeper kept the
    closed one, so every later sample raised gRPC's ValueError of a closed channel and the last
    step's batch stayed leased (a helper's audit). The keeper follows the storage's client."""
    with BufferClient(target) as admin:
        admin.create_table("reopen", group_size=2, estimator="grpo")
        rb = buffer(target, "reopen", 2, lease_seconds=60.0)
        rb.extend(groups(["a", "b", "c"], 2))
        first = uids_of(rb.sample())
        if reconnect == "close":
            rb.storage.close()
        else:
            rb.storage.load_state_dict({"target": target.replace("127.0.0.1", "localhost"), "table": "reopen"})
        second = uids_of(rb.sample())  # acknowledges the first batch
        assert not set(second) & set(first)
        table = admin.stats("reopen")["reopen"]
        assert (table.consumed, table.leased, table.ready) == (2, 2, 2), table


def test_a_long_step_keeps_its_batch(target) -> None:
    """The lease is renewed while the trainer lives: a step four leases long keeps its groups."""
    with BufferClient(target) as admin:
        admin.create_table("long", group_size=2, estimator="grpo")
        rb = buffer(target, "long", 2, lease_seconds=1.0)
        rb.extend(groups(["a"], 2))
        rb.sample()
        threading.Event().wait(4.0)  # the step
        table = admin.stats("long")["long"]
        assert (table.leased, table.leases_expired) == (2, 0)
        rb.sampler.close()  # a run abandoned mid-step: the batch goes back now
        assert admin.stats("long")["long"].ready == 2


def test_state_dict_says_where_the_data_is_and_a_checkpoint_acknowledges_its_step(target, tmp_path) -> None:
    with BufferClient(target) as admin:
        admin.create_table("ckpt", group_size=2, estimator="grpo")
        rb = buffer(target, "ckpt", 2, lease_seconds=60.0)
        rb.extend(groups(["a", "b"], 2))
        trained = uids_of(rb.sample())
        state = rb.state_dict()
        assert state["_storage"] == {"target": target, "table": "ckpt"}
        assert set(state["_sampler"]) == {"lease_id"} and state["_sampler"]["lease_id"]
        rb.dumps(tmp_path / "rb")
        rb.sampler._keeper.close()  # the trainer dies right after its checkpoint
        restored = ReplayBuffer(  # a wait of 1 s: its last sample waits it out, a longer one shows nothing more
            storage=ExpbufStorage("127.0.0.1:1", "elsewhere"), sampler=ExpbufSampler(timeout=1), batch_size=2
        )
        restored.loads(tmp_path / "rb")
        assert (restored.storage.target, restored.storage.table) == (target, "ckpt")
        nxt = uids_of(restored.sample())
        assert not set(nxt) & set(trained)  # the checkpoint's step is not trained again
        assert admin.stats("ckpt")["ckpt"].consumed == 2
        with pytest.raises(DeadlineExceededError):
            restored.sample()  # nothing else is left: the checkpoint's batch did not come back


def test_refusals_name_the_problem(target) -> None:
    with BufferClient(target) as admin:
        admin.create_table("by_run", group_by="run", group_size=2, estimator="grpo")
        admin.create_table("tokens", group_size=2, estimator="discounted_return", estimator_params={"gamma": 0.5})
        admin.create_table("ok", group_size=2, estimator="grpo")
        with pytest.raises(ValueError, match=r"group_by='run'.*group_by = 'task'"):
            ReplayBuffer(storage=ExpbufStorage(target, "by_run")).extend(groups(["a"], 2))
        with pytest.raises(ValueError, match="'missing' does not exist"):
            ReplayBuffer(storage=ExpbufStorage(target, "missing")).extend(groups(["a"], 2))
        nameless = groups(["a"], 2).exclude("query")
        with pytest.raises(ValueError, match="no group name at 'query'"):
            ReplayBuffer(storage=ExpbufStorage(target, "ok")).extend(nameless)
        padded = element("a", 0, 1.0)
        padded["tokens"].padded = True
        with pytest.raises(ValueError, match="padded"):
            ReplayBuffer(storage=ExpbufStorage(target, "ok")).add(padded)
        with pytest.raises(TypeError, match=r"no max_size: the table's capacity settings"):
            ExpbufStorage(target, "ok", max_size=1000)  # TorchRL storages take one; the table bounds this one
        with pytest.raises(TypeError, match="unexpected keyword argument 'tokn'"):
            ExpbufStorage(target, "ok", tokn="secret")  # refused where it is made, not at the first call
        top = TensorDictReplayBuffer(storage=ExpbufStorage(target, "ok"), writer=TensorDictMaxValueWriter())
        with pytest.raises(ValueError, match="TensorDictMaxValueWriter has no effect on an expbuf storage"):
            top.extend(groups(["a"], 2))
        with pytest.raises(ValueError, match="window is not an option"):
            ExpbufSampler(window=2)
        with pytest.raises(ValueError, match="lease_seconds"):
            ExpbufSampler(lease_seconds=-1)
        assert admin.stats("ok")["ok"].pushed == 0
        rb = buffer(target, "tokens", 2)
        rb.extend(groups(["a"], 2))  # returns-to-go discounted by 0.5: a value per token
        with pytest.raises(ValueError, match="vary over its tokens"):
            rb.sample()
        assert admin.stats("tokens")["tokens"].ready == 2  # the batch went back


def test_the_docs_snippet_runs(target, capsys) -> None:
    snippet = code_blocks(page("frameworks/torchrl.md"), "python")[0]
    exec(compile(snippet.replace("127.0.0.1:50051", target), "frameworks/torchrl.md", "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out
    assert printed.count("2+2=") == 4 and printed.count("3+3=") == 4
    with BufferClient(target) as admin:
        table = admin.stats("grpo4")["grpo4"]
    assert (table.consumed, table.leased) == (8, 0)


@pytest.mark.parametrize("delivery", ["lease", "consume", "replay"])
@pytest.mark.parametrize("kind", ["ReplayBuffer", "TensorDictReplayBuffer"], indirect=True)
def test_prefetch_is_refused_at_the_first_sample_before_anything_is_drawn(target, kind, delivery) -> None:
    """TorchRL's prefetch draws on threads ahead of the trainer and never tells the sampler which
    batch a step took. Leased, the first sample() with prefetch=2 left the trainer in its first
    step with that batch and the next already acknowledged (consumed 4 of 6, the third leased in
    the queue): a crash then lost both. Consumed, the batches drawn ahead left the table
    untrained (consumed 6 of 8 while the trainer held 2); replayed, a for loop could end in
    DeadlineExceededError from a prefetch thread's draw. So the buffer is refused by name,
    whatever the delivery, and the table is left as it was."""
    with BufferClient(target) as admin:
        admin.create_table("ahead", group_size=2, estimator="grpo")
        sampler = ExpbufSampler(timeout=1, delivery=delivery)
        rb = kind(storage=ExpbufStorage(target, "ahead"), sampler=sampler, batch_size=2, prefetch=2)
        rb.extend(groups(["a", "b", "c"], 2))
        message = rf"ExpbufSampler\(delivery='{delivery}'\) does not work with prefetch=2: .* without prefetch"
        with pytest.raises(ValueError, match=message):
            rb.sample()
        with pytest.raises(ValueError, match=message):
            next(iter(rb))
        table = admin.stats("ahead")["ahead"]
        assert (table.ready, table.leased, table.consumed) == (6, 0, 0)
        assert {e.times_sampled for e in admin.list_experiences("ahead").experiences} == {0}
        plain = kind(storage=ExpbufStorage(target, "ahead"), sampler=ExpbufSampler(timeout=1), batch_size=2)
        assert len([batch for batch in plain]) == 3  # the same table, without prefetch


@pytest.mark.parametrize("kind", ["ReplayBuffer", "TensorDictReplayBuffer"], indirect=True)
def test_torchrls_positional_max_size_is_refused_by_name_where_the_storage_is_made(target, kind) -> None:
    """TorchRL's storages take max_size as their first argument (`ListStorage(100)`); an expbuf
    storage's first is the server's target. `ExpbufStorage(100)` under TorchRL's buffer failed at
    its first write inside gRPC ("'int' object has no attribute 'encode'"): it is refused where it
    is made, naming max_size and the target, and nothing is pushed."""
    with BufferClient(target) as admin:
        admin.create_table("sized", group_size=2, estimator="grpo")
        with pytest.raises(TypeError, match=r"ExpbufStorage\(100\).*target \(HOST:PORT\).*max_size"):
            kind(storage=ExpbufStorage(100), sampler=ExpbufSampler(timeout=1), batch_size=2)
        with pytest.raises(TypeError, match=r"ExpbufStorage\(100\).*max_size"):
            kind(storage=lambda: ExpbufStorage(100), batch_size=2)  # TorchRL makes it from a callable too
        with pytest.raises(TypeError, match=r"table is 100.*a table's name"):
            ExpbufStorage(target, 100)
        rb = kind(storage=ExpbufStorage(target, "sized"), sampler=ExpbufSampler(timeout=1), batch_size=2)
        rb.extend(groups(["a"], 2))
        assert admin.stats("sized")["sized"].pushed == 2  # the storage made right writes


@pytest.mark.parametrize("kind", ["ReplayBuffer", "TensorDictReplayBuffer"], indirect=True)
@pytest.mark.parametrize("drop_last", [True, False])
def test_drop_last_is_honoured_as_torchrls_samplers_honour_it(target, kind, drop_last) -> None:
    """TorchRL's drop_last (SamplerWithoutReplacement's): True drops the last incomplete batch, so
    a `for` loop over the buffer ends without it, and the group left waits in the table for more;
    False keeps it, a short batch (expbuf's allow_partial=True) after the wait."""
    with BufferClient(target) as admin:
        table = f"last{int(drop_last)}{kind.__name__}"
        admin.create_table(table, group_size=2, estimator="grpo")
        sampler = ExpbufSampler(timeout=1, drop_last=drop_last)
        rb = kind(storage=ExpbufStorage(target, table), sampler=sampler, batch_size=4)
        rb.extend(groups(["a", "b", "c"], 2))
        sizes = [len(batch) for batch in rb]
        stats = admin.stats(table)[table]
        if drop_last:
            assert sizes == [4] and (stats.consumed, stats.ready) == (4, 2)
        else:
            assert sizes == [4, 2] and (stats.consumed, stats.ready) == (6, 0)


def test_drop_last_and_allow_partial_that_disagree_are_refused_by_name() -> None:
    """expbuf's allow_partial is TorchRL's drop_last turned over: given both, they must agree."""
    for drop_last, allow_partial in ((True, True), (False, False)):
        with pytest.raises(ValueError, match=rf"drop_last={drop_last} and allow_partial={allow_partial}"):
            ExpbufSampler(drop_last=drop_last, allow_partial=allow_partial)
    with pytest.raises(ValueError, match="drop_last is 1; it must be True or False"):
        ExpbufSampler(drop_last=1)
    assert ExpbufSampler(drop_last=False, allow_partial=True).options["allow_partial"] is True


def test_a_batch_whose_ack_failed_is_acked_at_close_never_given_back(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """The server restarts after the last step: the sampler's ack() fails and keeps the batch, and
    close() gave it back as a batch no step had trained, so it was served again. It acks it now
    (made again while the server is unavailable, for the client's timeout)."""
    data = str(tmp_path / "data")
    server = serve(data)
    port = server.port
    with BufferClient(server.target) as admin:
        admin.create_table("acks", group_size=2, estimator="grpo")
    rb = ReplayBuffer(
        storage=ExpbufStorage(server.target, "acks", timeout=5), sampler=ExpbufSampler(timeout=5), batch_size=2
    )
    rb.extend(groups(["a", "b"], 2))
    trained = uids_of(rb.sample())
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    with pytest.raises(DeadlineExceededError):  # an ack waits for the server (wait_for_ready), for the timeout
        rb.sampler.ack()  # after the last step, as the sampler's docs say
    server = serve(data, "--port", str(port))
    rb.sampler.close()
    with BufferClient(server.target, wait_for_ready=True) as admin:
        stats = admin.stats("acks")["acks"]
        assert (stats.consumed, stats.leased, stats.ready) == (2, 0, 2), (trained, stats)
