"""An asynchronous GRPO loop with a staleness bound of 2: rollout workers run ahead of the
trainer, but never more than two policy versions.

    python examples/async_grpo.py --target 127.0.0.1:50051 --workers 2 --steps 6

The table counts rollouts in groups: the trainer takes 4 groups per step (batch_size = 4),
so while the trainer is at version v, at most (2 + v + 1) * 4 groups may have started.
Workers ask `admit` before each rollout, tag it with the version of the weights they
used, and finish the grant; the trainer reports its version after each step and samples
only groups at most two versions behind. Pushes staler than that are dropped.

Each run is a job that starts over at version 0: it drops the table an earlier run left
(`drop_table`, an admin call) and makes it anew. Its groups were made by that run's policy,
versions ahead of this one's step 0, and the table kept its trainer version (which only moves
forward) and admission count; a job that means to train on what an earlier run left keeps the
table and resets only those (`reset_offpolicy`, docs/concepts/staleness.md). Its rollouts carry
a batch id of their own, so a second run's uids never meet the first's.
"""

from __future__ import annotations

import argparse
import random
import secrets
import threading

import torch

from expbuf.client import EID, BufferClient, Experience

TABLE = "grpo_async"
GROUP_SIZE = 4  # runs per task
GROUPS_PER_STEP = 4  # the trainer's batch, in groups: the table's batch_size
STALENESS = 2
RUN = secrets.token_hex(4)  # this run's batch ids


def rollout(worker: int, task: int, run: int, model_version: int) -> Experience:
    """Stands in for generating a response with the weights of `model_version` and scoring it."""
    prompt, response = 16, random.randint(8, 32)
    return Experience(
        eid=EID(batch=f"{RUN}-{worker}", task=task, run=run),
        tokens=torch.randint(0, 32_000, (prompt + response,), dtype=torch.int32),
        prompt_length=prompt,
        logprobs=-torch.rand(response),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=float(run % 2),  # never all equal: no group is dropped for zero variance
        info={"model_version": model_version},
    )


def rollout_worker(target: str, worker: int, stop: threading.Event) -> None:
    with BufferClient(target) as client:
        task = 0
        while not stop.is_set():
            grant = client.admit(TABLE, 2, wait=1.0)  # room for up to 2 groups, or wait for the trainer
            if not grant.count:
                continue
            version = max(0, client.stats(TABLE)[TABLE].trainer_version)  # the weights this worker loads
            accepted = 0
            for _ in range(grant.count):
                group = [rollout(worker, task, run, version) for run in range(GROUP_SIZE)]
                # kept: stored now, or by an earlier try whose reply was lost
                accepted += len(client.push(group, table=TABLE).kept) == GROUP_SIZE
                task += 1
            client.finish_grant(grant, accepted=accepted)  # dropped groups give their room back


def trainer(target: str, steps: int) -> None:
    with BufferClient(target) as client:
        for version in range(steps):
            batch = next(
                client.sample(
                    TABLE,
                    num_groups=GROUPS_PER_STEP,
                    min_model_version=max(0, version - STALENESS),
                    trainer_version=version,
                    timeout=60,
                    max_batches=1,
                    delivery="lease",  # the default, named: a step that dies gives its groups back
                )
            )
            lag = max(version - e.info["model_version"] for e in batch.experiences)
            print(f"step {version}: {len(batch.groups)} groups, at most {lag} versions behind")
            batch.ack()  # the step is done: its groups leave the buffer
            client.set_trainer_version(version + 1, TABLE)  # after the optimizer step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with BufferClient(args.target) as client:
        if any(table.name == TABLE for table in client.list_tables()):
            client.drop_table(TABLE)  # a job that starts over: an earlier run's groups and versions go
        client.create_table(TABLE, group_size=GROUP_SIZE, max_staleness=STALENESS, batch_size=GROUPS_PER_STEP)
    stop = threading.Event()
    workers = [threading.Thread(target=rollout_worker, args=(args.target, i, stop)) for i in range(args.workers)]
    for thread in workers:
        thread.start()
    try:
        trainer(args.target, args.steps)
    finally:
        stop.set()
        for thread in workers:
            thread.join()


if __name__ == "__main__":
    main()
