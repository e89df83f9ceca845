"""A columnar reply's bytes, pinned: a mixed batch (items of different headers and of the same, a
field some lack or store with another dtype, a group's shared prompt, an experience stored in
chunks, advantages computed, the prefix + branches form, shares of the tokens) replies as columns
in the bytes that the gathering of one item at a time made, however the columns are gathered now.
Real LMDB; the replies as sample_reply and fields_reply build them for gRPC's send."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from expbuf.client import trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.client.trxp.stored.columns import Shares
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.rpc.sample.replies import fields_reply, sample_reply
from expbuf.server.store import Store
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

LIMIT = 1 << 30  # one message, whatever the reply's size
PROMPT = 200  # int64 tokens: 1.6 KB, a prompt the store keeps once for its group
BIG = 600_000  # int64 tokens of the experience stored in chunks (4.8 MB)
FIELDS = (
    "tokens", "logprobs", "action_mask", "advantages", "returns", "routed_experts", "prefix_tokens", "branch_tokens",
    "prefix_of", "reward", "length",
)  # fmt: skip
SHARED_FIELDS = ("tokens", "logprobs", "advantages", "routed_experts", "length")
# sha256 of each reply as the item-by-item gathering built it, and its length.
PINNED = {
    "grpo": ("4e761bd327e26ec0e517c068567c3b0a1499f42508ff33c8a427cba3c3050105", 18_610_701),
    "plain": ("97283ab0d66c8ee86216fb9a7599cfb2679ce1b890ce476513394d8467a1f36d", 13_809_888),
    "grpo-shares": ("dd3fe127ff5d8d0c934c13d8e39293c129cb3a2afb3211e0904df29ea9d71c84", 5_404_148),
    "plain-shares": ("71d15b3513eb6e647ece4d48391155859ad0a639955bf52066813edf35e1c56e", 4_203_841),
}


def rollout(task: int, run: int, response: int, *, prompt: int = 5, logprobs: str = "f32") -> Experience:
    """A run of a task: the task's prompt, its own response; log-probs as float32, bfloat16 or none,
    routing ids for odd tasks."""
    prompt_tokens = torch.arange(prompt, dtype=torch.int64) * 7 + task
    length = prompt + response
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    return Experience(
        eid=EID(batch=0, task=task, run=run, suffix=f"r{run}"),
        tokens=torch.cat([prompt_tokens, torch.arange(response, dtype=torch.int64) + 100 * run]),
        prompt_length=prompt,
        logprobs=torch.linspace(-1, 0, response, dtype=dtypes[logprobs]) if logprobs in dtypes else None,
        action_mask=torch.arange(response) % 3 != 0,
        routed_experts=(torch.arange(length * 2, dtype=torch.uint8) % 64).reshape(-1, 2) if task % 2 else None,
        reward=float(run * (task + 1)),
    )


def groups() -> list[list[Experience]]:
    """Four groups of three: runs that share their header, runs that do not, a log-prob column of two
    dtypes and an experience without one, a shared prompt (two of its runs of one header, their
    sections in pieces), and an experience stored in chunks."""
    return [
        [rollout(0, run, 6) for run in range(3)],  # one header
        [rollout(1, 0, 4), rollout(1, 1, 9, logprobs="bf16"), rollout(1, 2, 7, logprobs="none")],
        [rollout(2, run, 10 + run // 2, prompt=PROMPT) for run in range(3)],  # a prompt stored once: pieces
        [rollout(3, 0, 3), rollout(3, 1, BIG), rollout(3, 2, 0)],  # chunks; a run of no response
    ]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "data", map_size=1 << 30, seed=1) as s:
        for name, estimator in (("grpo", "grpo"), ("plain", "none")):
            s.create_table(TableConfig.of(name=name, estimator=estimator, group_by="task", group_size=3))
            for group in groups():
                s.put(name, [trxp.from_experience(exp) for exp in group])
            AdvantageWorker(s).run_once()
        yield s


def digest(messages: Iterator[bytes]) -> tuple[str, int]:
    reply = b"".join(messages)
    return hashlib.sha256(reply).hexdigest(), len(reply)


@pytest.mark.parametrize("table", ["grpo", "plain"])
def test_a_mixed_batch_replies_as_columns_in_the_bytes_pinned(store: Store, table: str) -> None:
    spec = TakeSpec(table, num_groups=4, delivery="replay", fields=FIELDS)
    batch = store.sample(spec)
    assert batch is not None and len(batch.uids) == 12
    assert digest(sample_reply(batch, spec, 0.0, LIMIT, True)) == PINNED[table]


@pytest.mark.parametrize("table", ["grpo", "plain"])
def test_shares_of_a_mixed_batch_reply_in_the_bytes_pinned(store: Store, table: str) -> None:
    uids = store.sample(TakeSpec(table, num_groups=4, delivery="replay")).uids  # type: ignore[union-attr]
    batch, missing = store.read_fields(table, [*uids, "absent"], Shares(4, (3, 0)))
    assert missing == ["absent"]
    assert digest(fields_reply(batch, SHARED_FIELDS, missing, LIMIT, True)) == PINNED[f"{table}-shares"]
