"""TorchRL's ReplayBuffer on data-parallel ranks: two processes under torch.distributed (gloo, on
the CPU), each with its own ReplayBuffer over an ExpbufStorage and an ExpbufSampler(ranks=2,
rank=r), sample step after step in lockstep. Rank 0 leases each step; each rank reads its part
of it (get_part), whole groups split by tokens; the step is acknowledged once both ranks came
back for the next. A real server (in-process, tests/conftest.py), real processes, TorchRL's own
ReplayBuffer driving the sampler."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp
from test_torchrl import groups

from expbuf.client import BufferClient, DeadlineExceededError


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global torch, set_list_to_stack, ReplayBuffer, ExpbufSampler, ExpbufStorage
    import test_torchrl

    test_torchrl.import_frameworks()
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrl")
    from tensordict import set_list_to_stack
    from torchrl.data import ReplayBuffer

    from expbuf.client.torchrl import ExpbufSampler, ExpbufStorage


QUERIES = [f"q{i}" for i in range(8)]
STEPS = 2
PER_RANK = 8  # experiences a rank's step holds: two groups of four


def rank_main(rank: int, target: str, table: str, where: str) -> None:
    """One rank's process: sample STEPS steps, write what each held, acknowledge the last."""
    import_frameworks()  # a spawned process: this module imported anew, conftest's fixture not run
    dist.init_process_group("gloo", init_method=f"file://{where}/group", rank=rank, world_size=2)
    try:
        with set_list_to_stack(True):
            sampler = ExpbufSampler(ranks=2, rank=rank, timeout=3)
            rb = ReplayBuffer(storage=ExpbufStorage(target, table), sampler=sampler, batch_size=PER_RANK)
            steps = []
            for _ in range(STEPS):
                batch = rb.sample()
                steps.append({"uids": list(batch["expbuf", "uid"]), "queries": list(batch["query"])})
                dist.barrier()  # the step's update, which every rank takes part in
            sampler.ack()  # the last step done: no sample follows to acknowledge it
            try:  # the table ran dry: rank 0's draw times out, and every rank hears of it
                rb.sample()
                dry = "sampled"
            except DeadlineExceededError as exc:
                dry = exc.details
            sampler.close()
        Path(where, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "dry": dry}))
    finally:
        dist.destroy_process_group()


def test_each_rank_samples_its_part_of_a_step_rank_0_leased(target: str, tmp_path: Path) -> None:
    with BufferClient(target) as admin:
        admin.create_table("ranks", group_size=4, estimator="grpo")
        with set_list_to_stack(True):
            ReplayBuffer(storage=ExpbufStorage(target, "ranks"), sampler=ExpbufSampler()).extend(groups(QUERIES, 4))
        tmp.spawn(rank_main, args=(target, "ranks", str(tmp_path)), nprocs=2, join=True)
        stats = admin.stats("ranks")["ranks"]
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert found[0]["dry"] == found[1]["dry"] != "sampled"  # rank 1 raised what rank 0 met, not hung
    ranks = [rank["steps"] for rank in found]
    seen: list[str] = []
    for step in range(STEPS):
        parts = [ranks[rank][step] for rank in range(2)]
        assert not set(parts[0]["uids"]) & set(parts[1]["uids"])  # no run on both ranks
        for part in parts:
            assert set(Counter(part["queries"]).values()) == {4}  # whole groups
        seen += parts[0]["queries"] + parts[1]["queries"]
    assert Counter(seen) == {query: 4 for query in QUERIES}  # every group once, over the two steps
    assert (stats.consumed, stats.leased, stats.ready) == (32, 0, 0)  # both steps acknowledged


def test_a_sampler_of_several_ranks_leases_and_names_its_rank() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2 ranks"):
        ExpbufSampler(ranks=2, rank=2)
    with pytest.raises(ValueError, match="delivery='consume' is not one it takes"):
        ExpbufSampler(ranks=2, rank=0, delivery="consume")
