"""A verl V1 trainer's loop around ExpbufReplayBuffer in mirror mode, run as a child process on the
test's Ray cluster and TransferQueue, so that the crash test can kill it with SIGKILL.

tests/test_verl_buffer.py runs `run` in processes forked by multiprocessing's forkserver, which has
imported verl, Ray and TransferQueue once (some 8 s), not at each start.

Each step dispatches two prompts while the step is at most DISPATCH_UNTIL (verl's prepare_step),
samples two groups through the buffer, "trains" them (a `trained UID` line in LOG, fsynced) and
clears their keys as verl's fit loop does. At step DIE_AT it dispatches its prompts, waits until
the mirror has pushed them (`pushed UID` lines), samples (`sampled UID` lines: the step that
dies with them), writes `ready` and waits to be killed.
"""

from __future__ import annotations

import os
import time

import ray
import transfer_queue as tq

from expbuf.client import BufferClient
from expbuf.client.verl import from_verl

from test_verl import dispatch
from test_verl_buffer import build, group_rows, import_frameworks


def run(gcs: str, target: str, table: str, steps: tuple[int, ...], log_path: str, err_path: str) -> None:
    """The trainer: steps are FIRST_STEP, LAST_STEP, DISPATCH_UNTIL and DIE_AT if it is to die;
    what it writes to stderr goes to `err_path`."""
    with open(err_path, "a") as err:  # a file: a full pipe would stall the child
        os.dup2(err.fileno(), 2)
    first, last, dispatch_until, *die = steps
    import_frameworks()  # test_verl_buffer's and test_verl's, which build and dispatch use
    die_at = die[0] if die else None
    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    tq.init()
    buffer = build(target, table, threshold=None)
    with open(log_path, "a") as log, BufferClient(target) as client:

        def note(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

        for step in range(first, last + 1):
            uids = [dispatch(step), dispatch(step)] if step <= dispatch_until else []
            if step == die_at:
                eids = [e.eid.uid for uid in uids for e in from_verl(group_rows(uid))]
                while client.get(eids, table).missing_uids:
                    time.sleep(0.05)
                for uid in uids:
                    note(f"pushed {uid}")
                meta, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=2)
                for uid in sorted({key.split("_")[0] for key in meta.keys}):
                    note(f"sampled {uid}")
                note("ready")
                time.sleep(600)
            meta, _ = buffer.sample(global_steps=step, partition_id="train", batch_size=2)
            for uid in sorted({key.split("_")[0] for key in meta.keys}):
                note(f"trained {uid}")
            tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
    buffer.close()
    ray.shutdown()  # what the interpreter's exit did when this ran as a script: a forked child skips it
