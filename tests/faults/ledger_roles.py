"""The processes of the prompt-ledger crash matrix (test_fault_ledger.py), each a user of the
public client API only:

    python ledger_roles.py worker|trainer TARGET WORKDIR NAME

A rollout worker claims two prompts at a time, pushes each one's group in two halves (so that
a kill can leave an attempt's group incomplete), renews the claims it still works on after
each push, and ends when a claim says the dataset is done. The trainer leases batches of whole groups, appends each
batch's groups to WORKDIR/trainer.log and fsyncs it before it acks, then logs the ack's
outcome, each line with its NAME (one per process); it ends when the ledger says the dataset
is done. Both go on through a server that
is down (it comes back on the same address). Each touches WORKDIR/NAME.ready once it has
reached the server. Until WORKDIR/finish exists, each paces itself
(a random pause per half group and per batch), so the kills land while the run is busy.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from expbuf.client import BufferClient, ExpbufError, Experience, FailedPreconditionError, NotFoundError, Prompt

T = TypeVar("T")
TABLE, DATASET = "ledger", "prompts"
GROUP = 4  # the table's group size: runs per prompt
CLAIM_SECONDS = 2.0  # a killed worker's prompts come back this soon
TRAINER_LEASE_SECONDS = 5.0  # longer than a server's restart, so an ack after one finds its lease
PACE = 0.15  # the longest pause per half group and per batch until WORKDIR/finish exists
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
PATIENCE = 60.0  # how long a call goes on being retried while the server is away


def through_restarts(call: Callable[[], T]) -> T:
    """`call()`, again while the server is away (killed, restarting)."""
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            return call()
        except ExpbufError as exc:
            if exc.code not in GONE or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def pause(workdir: Path) -> None:
    if not (workdir / "finish").exists():
        time.sleep(random.uniform(0, PACE))


def experience(prompt: Prompt, run: int) -> Experience:
    """Run `run` of the prompt's attempt; rewards differ within a group (0 and 1 by run)."""
    return Experience(
        eid=prompt.eid(run),
        tokens=torch.arange(8, dtype=torch.int32),
        prompt_length=4,
        logprobs=torch.full((4,), -0.5),
        action_mask=torch.ones(4, dtype=torch.bool),
        reward=float(run % 2),
        info={"model_version": 0},
    )


def worker(client: BufferClient, workdir: Path, name: str) -> None:
    events = (workdir / f"{name}.events").open("a")
    while True:
        try:
            claim = client.claim(TABLE, DATASET, 2, lease_seconds=CLAIM_SECONDS, owner=name, wait=1.0)
        except ExpbufError as exc:  # not retried by the client: a claim whose reply was lost is not repeated
            if exc.code not in GONE:
                raise
            time.sleep(0.1)
            continue
        if claim.done:
            return
        held = list(claim.prompts)
        for prompt in claim.prompts:
            group = [experience(prompt, run) for run in range(GROUP)]
            for half in (group[: GROUP // 2], group[GROUP // 2 :]):
                if prompt not in held:  # a renewal found its claim ended: give it up
                    events.write(f"ended {prompt.group}\n")
                    break
                pause(workdir)  # generating
                try:
                    through_restarts(lambda half=half: client.push(half, TABLE))
                except FailedPreconditionError:  # its claim ended while the server was away: refused
                    events.write(f"refused {prompt.group}\n")
                    held.remove(prompt)
                    break
                if half[-1] is group[-1]:
                    held.remove(prompt)  # its group is complete: the prompt is generated
                if held:  # the heartbeat of the claims still being worked on
                    ended = through_restarts(lambda held=held: client.renew_claims(held, CLAIM_SECONDS))
                    held = [p for p in held if p not in ended]
        events.flush()


def log_line(log: Any, record: dict[str, Any]) -> None:
    """Append a line to the trainer's log, on disk when this returns."""
    log.write(json.dumps(record) + "\n")
    log.flush()
    os.fsync(log.fileno())


def ack(client: BufferClient, lease_id: str) -> str:
    """Ack a lease through restarts: "acked", or "not_found" (its lease ended first, or an
    earlier attempt that the server's kill cut short had acked it)."""
    try:
        return "acked" if through_restarts(lambda: client.ack(lease_id, TABLE)) else "empty"
    except NotFoundError:
        return "not_found"


def trainer(client: BufferClient, workdir: Path, name: str) -> None:
    log = (workdir / "trainer.log").open("a")
    while True:
        try:
            for batch in client.sample(
                TABLE,
                num_groups=2,
                delivery="lease",
                lease_seconds=TRAINER_LEASE_SECONDS,
                timeout=1.0,
                allow_partial=True,
            ):
                groups: dict[str, list[list[Any]]] = {}
                for gid, exp in zip(batch.group_ids, batch.experiences, strict=True):
                    groups.setdefault(gid, []).append([exp.eid.batch, exp.eid.task, exp.eid.run])
                log_line(log, {"name": name, "lease": batch.lease_id, "groups": groups})
                pause(workdir)  # the step
                log_line(log, {"name": name, "lease": batch.lease_id, "ack": ack(client, batch.lease_id)})
        except ExpbufError as exc:
            if exc.code not in GONE:
                raise
            time.sleep(0.1)
            continue
        if through_restarts(lambda: client.ledger(TABLE, DATASET)).done:
            return


def main() -> None:
    role, target, workdir, name = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    with BufferClient(target, timeout=10) as client:
        through_restarts(lambda: client.ledger(TABLE, DATASET))
        (workdir / f"{name}.ready").touch()  # started: from now on a kill lands in its work
        (worker if role == "worker" else trainer)(client, workdir, name)


if __name__ == "__main__":
    main()
