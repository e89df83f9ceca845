"""An experience's identity: expbuf's EID names the same uid for the same batch/task/run/step, so
a worker that builds its rollouts again stores nothing twice; an experience without an eid has no
group to join in a table that groups."""

from __future__ import annotations

import re

import pytest
import torch

from expbuf.client import EID, AlreadyExistsError, BufferClient, Experience, InvalidArgumentError, trxp
from expbuf.client.schema.reasons import Reason


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global TrinityEID, TrinityExperience
    from trinity.common.experience import EID as TrinityEID
    from trinity.common.experience import Experience as TrinityExperience


def rollout(task: int, run: int, *, response: int = 4) -> Experience:
    """A rollout made anew each call (new objects) from its task and run, as a worker that restarts makes it."""
    return Experience(
        eid=EID(batch=3, task=task, run=run),
        tokens=torch.arange(8 + response, dtype=torch.int64) + run,
        prompt_length=8,
        reward=float(run % 2),
    )


def test_a_worker_that_builds_its_rollouts_again_stores_nothing_twice(client: BufferClient) -> None:
    """The group keeps its runs once each: four stored, four duplicates, then the other four
    complete it at 8 (a second run 0 was stored before, and the group filled with copies)."""
    client.create_table("g8", group_size=8)
    first = client.push([rollout(0, run) for run in range(4)], table="g8")
    again = client.push([rollout(0, run) for run in range(4)], table="g8")
    assert (again.stored, sorted(again.duplicates)) == ([], sorted(first.stored))
    stats = client.stats("g8")["g8"]
    assert (stats.pending, stats.groups_pending, stats.duplicates) == (4, 1, 4)
    rest = client.push([rollout(0, run) for run in range(4, 8)], table="g8")
    assert rest.completed_groups == ["3/0"]
    whole = client.push([rollout(0, run) for run in range(8)], table="g8")  # the complete group, again
    assert whole.stored == [] and len(whole.duplicates) == 8
    (batch,) = client.sample("g8", num_groups=1, max_batches=1, delivery="consume")
    assert sorted(exp.eid.run for exp in batch.experiences) == list(range(8))


def test_a_run_built_again_with_other_content_is_refused_naming_its_uid(client: BufferClient) -> None:
    client.create_table("g8", group_size=8)
    client.push([rollout(0, run) for run in range(4)], table="g8")
    with pytest.raises(AlreadyExistsError, match=re.escape("uid 3/0/1/0/ already exists with different content")):
        client.push([rollout(0, 1, response=5)], table="g8")
    assert client.stats("g8")["g8"].pending == 4


def test_an_eid_names_its_uid_as_trinitys_does_and_without_one_is_unique() -> None:
    """Trinity-RFT's defaults (batch and task empty, run and step 0); a given batch or task makes
    the suffix empty (the uid the same each time, as a prompt's `eid(run)`), none makes it new."""
    ours, theirs = EID(), TrinityEID()
    assert (ours.batch, ours.task, ours.run, ours.step) == (theirs.batch, theirs.task, theirs.run, theirs.step)
    assert re.fullmatch(r"[0-9a-f]{24}", ours.suffix) and EID().suffix != ours.suffix
    assert EID(batch=3, task=0, run=1).uid == "3/0/1/0/" == EID(batch=3, task=0, run=1).uid
    assert EID(task="t").uid == "/t/0/0/" and EID(batch=0).uid == "0//0/0/"
    assert EID(batch=3, task=0, run=1, suffix="x").uid == "3/0/1/0/x" == TrinityEID(3, 0, 1, 0, "x").uid
    # The same parts encode to the same TRXP bytes from either class.
    tokens = torch.arange(6)
    made = Experience(tokens=tokens, eid=EID(batch=3, task=0, run=1), prompt_length=2, reward=1.0)
    trinity = TrinityExperience(tokens=tokens, eid=TrinityEID(3, 0, 1, 0, ""), prompt_length=2, reward=1.0)
    assert trxp.parse(trxp.encode([made]))[0].uid == trxp.parse(trxp.encode([trinity]))[0].uid == "3/0/1/0/"


@pytest.mark.parametrize("group_by", ["task", "run", "step"])
def test_experiences_without_an_eid_are_refused_by_a_table_that_groups(client: BufferClient, group_by: str) -> None:
    """They all joined one group ('0/0', the old defaults): eight completed it, the ninth was
    refused 'already complete'."""
    client.create_table("g", group_by=group_by, group_size=8)
    bare = [Experience(tokens=torch.arange(6), prompt_length=2, reward=1.0) for _ in range(3)]
    trinitys = [TrinityExperience(tokens=torch.arange(6), prompt_length=2, reward=1.0)]
    for items in (bare, trinitys, [rollout(0, 0), *bare]):
        with pytest.raises(InvalidArgumentError) as raised:
            client.push(items, table="g")
        error = raised.value
        assert error.reason == Reason.INVALID_PAYLOAD
        assert f"has no eid (its batch and task are empty), and table 'g' groups by {group_by}" in error.details
        assert "EID(batch=..., task=..., run=...)" in error.details
    assert client.stats("g")["g"].pushed == 0


def test_experiences_without_an_eid_are_each_their_own_in_a_table_that_does_not_group(client: BufferClient) -> None:
    client.create_table("single", group_by="none")
    for _ in range(2):
        result = client.push([Experience(tokens=torch.arange(6), prompt_length=2, reward=1.0)], table="single")
        assert len(result.stored) == 1 and result.stored[0].startswith("//0/0/")
    assert client.stats("single")["single"].pushed == 2


def test_eids_without_a_batch_or_task_never_share_a_uid_and_sort_as_they_were_made() -> None:
    """Each gets a suffix of its own: 6 random hex digits (Trinity-RFT's) were shared by two of some
    thousands, and the second one's push refused as a conflict with the first; and their uids sort in
    the order they were made, so that a table's keys land in push order."""
    made = [EID().uid for _ in range(200_000)]
    assert len(set(made)) == len(made)
    assert made == sorted(made)
