"""A rollout worker: claims prompts from a dataset on expbuf and pushes a GRPO group (8 runs)
for each.

    python examples/rollout_worker.py --target 127.0.0.1:50051 --size 16

The dataset (prompts 0..size-1, `--epochs` times) is created on the first run and read on the
next ones. Each prompt comes with its attempt and the EID it must carry (`prompt.eid(run)`):
if this worker dies, its claims end after `--lease` seconds and the prompts go out again with
the next attempt, to this worker or another; a push for an ended attempt is refused, so a
group never mixes attempts. The worker renews the claims it still holds while it works, and
stops when the dataset is done (every prompt trained) or no prompt can be claimed for
`--wait` seconds (the rest are with other workers, or generated and waiting for the trainer).
Each push is durable when it returns; a retried one is reported as duplicates.
"""

from __future__ import annotations

import argparse
import random

import torch

from expbuf.client import BufferClient, Experience, FailedPreconditionError, Prompt


def rollout(prompt: Prompt, run: int, model_version: int) -> Experience:
    """Stands in for generating a response to the prompt and scoring it."""
    length, response = 16, random.randint(8, 64)
    return Experience(
        eid=prompt.eid(run),
        tokens=torch.randint(0, 32_000, (length + response,), dtype=torch.int32),
        prompt_length=length,
        logprobs=-torch.rand(response),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=float(random.random() < 0.5),
        info={"model_version": model_version},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--token", default=None)
    parser.add_argument("--table", default="default", help="a table that groups by task, 8 runs per group")
    parser.add_argument("--dataset", default="prompts")
    parser.add_argument("--size", type=int, default=16, help="prompts in the dataset")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--runs", type=int, default=8, help="runs per prompt: the table's group_size")
    parser.add_argument("--claim", type=int, default=4, help="prompts per claim")
    parser.add_argument("--lease", type=float, default=60.0, help="seconds a claim lasts unless renewed")
    parser.add_argument("--wait", type=float, default=10.0, help="seconds a claim may wait for a prompt")
    parser.add_argument("--model-version", type=int, default=0, help="the policy version that generated the rollouts")
    args = parser.parse_args()
    with BufferClient(args.target, token=args.token) as client:
        client.create_dataset(args.table, args.dataset, args.size, epochs=args.epochs, exist_ok=True)
        while True:
            claim = client.claim(args.table, args.dataset, args.claim, lease_seconds=args.lease, wait=args.wait)
            if claim.done:
                print(f"dataset {args.dataset} is done: every prompt is trained")
                break
            if not claim.prompts:
                print(f"no prompt to claim within {args.wait:g}s; stopping")
                break
            held = list(claim.prompts)
            for prompt in claim.prompts:
                ended = client.renew_claims(held, args.lease)  # still working: keep the claims
                held = [p for p in held if p not in ended]
                if prompt not in held:
                    print(f"prompt {prompt.epoch}/{prompt.index}: its claim ended; it goes out again")
                    continue
                group = [rollout(prompt, run, args.model_version) for run in range(args.runs)]
                where = f"prompt {prompt.epoch}/{prompt.index} attempt {prompt.attempt}"
                try:
                    result = client.push(group, table=args.table)
                except FailedPreconditionError as exc:  # its claim ended before the push
                    print(f"{where}: refused ({exc.details})")
                else:
                    print(f"{where}: stored {len(result.stored)}, duplicates {len(result.duplicates)}")
                held.remove(prompt)


if __name__ == "__main__":
    main()
