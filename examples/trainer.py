"""A trainer loop: takes batches of whole GRPO groups under a lease, with the advantages the
server computed, and acks each after its step.

    python examples/trainer.py --target 127.0.0.1:50051 --groups 4 --steps 4 --dataset prompts

If the trainer dies mid-step, the lease expires and the batch goes back to the
buffer for the next trainer: no batch is lost. An acked group trains its prompt in the
dataset's ledger (examples/rollout_worker.py claims the prompts); with --dataset the
trainer prints the ledger's counts at the end.
"""

from __future__ import annotations

import argparse

import torch

from expbuf.client import BufferClient
from expbuf.client.schema.prompts import STATES
from expbuf.client.torch import ExperienceDataset


def train_step(batch) -> float:
    """Stands in for a policy-gradient step on the advantages the server computed for each group.

    The table's estimator (grpo here) filled `advantages` in when each group completed: per
    token, the response length, zero where `action_mask` is 0. The trainer recomputes nothing.
    """
    losses = []
    for e in batch.experiences:
        mask = e.action_mask.float()
        losses.append(-(e.advantages * e.logprobs * mask).sum() / mask.sum().clamp(min=1))
    return float(torch.stack(losses).mean())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--token", default=None)
    parser.add_argument("--groups", type=int, default=4, help="whole groups per batch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for each batch")
    parser.add_argument("--table", default="default")
    parser.add_argument("--dataset", default=None, help="a dataset of the table whose ledger to show at the end")
    args = parser.parse_args()
    with BufferClient(args.target, token=args.token) as client:
        dataset = ExperienceDataset(
            client,
            table=args.table,
            num_groups=args.groups,
            delivery="lease",
            lease_seconds=300,
            max_batches=args.steps,
            timeout=args.wait,
        )
        for step, batch in enumerate(torch.utils.data.DataLoader(dataset, batch_size=None)):
            loss = train_step(batch)
            print(f"step {step}: {len(batch.uids)} experiences from {len(batch.groups)} groups, loss {loss:.4f}")
        if args.dataset:
            info = client.ledger(args.table, args.dataset)
            counts = ", ".join(f"{info.total(state)} {state}" for state in STATES)
            print(f"ledger of {args.dataset}: {counts} of {info.size} x {info.epochs} prompts; done: {info.done}")


if __name__ == "__main__":
    main()
