"""A rollout worker: pushes GRPO groups (8 runs of each task) to expbuf.

    python examples/rollout_worker.py --target 127.0.0.1:50051 --tasks 16

Each push is durable when it returns; a retry after a network error is reported
as duplicates, never stored twice. Every run pushes a new explorer batch (a new
eid batch, unless --batch names one), so the worker can be run again and again.
Trinity-RFT's own Experience objects can be pushed the same way.
"""

from __future__ import annotations

import argparse
import random
import time

import grpc
import torch

from expbuf.client import EID, BufferClient, BufferError, Experience


def rollout(batch: int, task: int, run: int, model_version: int) -> Experience:
    """Stands in for generating a response and scoring it."""
    prompt, response = 16, random.randint(8, 64)
    return Experience(
        eid=EID(batch=batch, task=task, run=run, step=0),
        tokens=torch.randint(0, 32_000, (prompt + response,), dtype=torch.int32),
        prompt_length=prompt,
        logprobs=-torch.rand(response),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=float(random.random() < 0.5),
        info={"model_version": model_version},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--token", default=None)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument(
        "--batch", type=int, default=None, help="explorer step (the eid's batch); default: a new one for every run"
    )
    parser.add_argument("--model-version", type=int, default=0, help="the policy version that generated the rollouts")
    args = parser.parse_args()
    batch = args.batch if args.batch is not None else time.time_ns() // 1_000_000  # milliseconds: new every run
    with BufferClient(args.target, token=args.token) as client:
        for task in range(args.tasks):
            group = [rollout(batch, task, run, model_version=args.model_version) for run in range(args.runs)]
            try:
                result = client.push(group)
            except BufferError as exc:
                if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                    raise
                print(f"task {task}: batch {batch} already holds this group ({exc.details}); skipped")
                continue
            print(f"task {task}: stored {len(result.stored)}, duplicates {len(result.duplicates)}")


if __name__ == "__main__":
    main()
