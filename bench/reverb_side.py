"""The DeepMind Reverb side of bench/bench_reverb.py; runs with a Python that has dm-reverb[tensorflow].

    reverb_side.py server   # prints 'listening on localhost:PORT' on stderr, serves until stdin closes
    reverb_side.py client TARGET   # reads one JSON command a line on stdin, answers one JSON line on stdout

The server holds two tables (8 KB and 40 KB experiences; one more each for the legacy writer),
uniform sampling, FIFO removal at
max_size, a MinSize(1) rate limiter that never binds once the table is filled. Reverb keeps
items in memory only: nothing is written to disk, nothing is fsynced.
Commands: {"op": "push" | "legacy", "shape": "8k"|"40k", "pushes": N, "per": K} inserts N x K
experiences one item each, with the trajectory writer or the legacy `client.writer` (its fastest
insert), flushing (waiting for the server's confirmation) after every K; with "window": W > 0,
pipelined as expbuf's pusher of window W is: the trajectory writer waits after each push until
at most W - 1 pushes' items are unconfirmed (`flush(block_until_num_items=...)`), the legacy
writer keeps at most W pushes' items unconfirmed (`max_in_flight_items`), and each flushes
(waits for every item) once, at the end;
{"op": "sample" | "dataset", "shape": ..., "count": N, "batch": B} reads N experiences with
`client.sample` or a batched `TrajectoryDataset`. Answers {"count": N, "seconds": S}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import reverb
import tensorflow as tf

SHAPES = {
    # int32[1024] tokens, float32[1023] logprobs: the same tensors as expbuf's 8 KB experience.
    "8k": {"tokens": ((1024,), np.int32), "logprobs": ((1023,), np.float32)},
    # bench_store.experience: int32[5000] tokens, float32[4000] logprobs, bool[4000] mask, reward.
    "40k": {
        "tokens": ((5000,), np.int32),
        "logprobs": ((4000,), np.float32),
        "action_mask": ((4000,), np.bool_),
        "reward": ((), np.float32),
    },
}
MAX_SIZE = {"8k": 20_000, "40k": 5_000}


def step(shape: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors, as incompressible as expbuf's (Reverb compresses chunks)."""
    out = {}
    for name, (dims, dtype) in SHAPES[shape].items():
        if dtype == np.int32:
            out[name] = rng.integers(0, 150_000, dims, dtype=np.int32)
        elif dtype == np.bool_:
            out[name] = np.ones(dims, dtype=np.bool_)
        else:
            out[name] = rng.standard_normal(dims, dtype=np.float32)
    return out


def serve() -> None:
    tables = [
        reverb.Table(
            name=shape,
            sampler=reverb.selectors.Uniform(),
            remover=reverb.selectors.Fifo(),
            max_size=MAX_SIZE[shape],
            rate_limiter=reverb.rate_limiters.MinSize(1),
            signature={name: tf.TensorSpec(dims, tf.as_dtype(dtype)) for name, (dims, dtype) in spec.items()},
        )
        for shape, spec in SHAPES.items()
    ] + [  # the legacy writer's items are sequences of one step: a table of their own, for pushes
        reverb.Table(
            name=f"{shape}-legacy",
            sampler=reverb.selectors.Uniform(),
            remover=reverb.selectors.Fifo(),
            max_size=MAX_SIZE[shape],
            rate_limiter=reverb.rate_limiters.MinSize(1),
        )
        for shape in SHAPES
    ]
    server = reverb.Server(tables=tables, port=None)
    print(f"listening on localhost:{server.port}", file=sys.stderr, flush=True)
    sys.stdin.read()
    server.stop()


def push(client: reverb.Client, shape: str, steps: list[dict], pushes: int, per: int, window: int = 0) -> float:
    """The trajectory writer: every item confirmed after each push, or with `window`, at most
    `window` - 1 pushes' items unconfirmed after each push (its items are sent as they are made)."""
    start = time.perf_counter()
    with client.trajectory_writer(num_keep_alive_refs=1) as writer:
        for p in range(pushes):
            for i in range(per):
                writer.append(steps[(p * per + i) % len(steps)])
                writer.create_item(shape, 1.0, {name: writer.history[name][-1] for name in SHAPES[shape]})
            writer.flush(block_until_num_items=max(window - 1, 0) * per)
        writer.flush()
    return time.perf_counter() - start


def legacy_push(client: reverb.Client, shape: str, steps: list[dict], pushes: int, per: int, window: int = 0) -> float:
    """The legacy writer: flushed after each push, or with `window`, at most `window` pushes'
    items unconfirmed at any time (create_item waits for room) and one flush at the end."""
    in_flight = {"max_in_flight_items": window * per} if window else {}
    start = time.perf_counter()
    with client.writer(max_sequence_length=1, **in_flight) as writer:
        for p in range(pushes):
            for i in range(per):
                writer.append(steps[(p * per + i) % len(steps)])
                writer.create_item(f"{shape}-legacy", num_timesteps=1, priority=1.0)
            if not window:
                writer.flush()
        writer.flush()
    return time.perf_counter() - start


def sample(client: reverb.Client, shape: str, count: int) -> float:
    start = time.perf_counter()
    got = 0
    for _ in client.sample(shape, num_samples=count, emit_timesteps=False):
        got += 1
    assert got == count, (got, count)
    return time.perf_counter() - start


def dataset(target: str, shape: str, count: int, batch: int) -> float:
    ds = reverb.TrajectoryDataset.from_table_signature(target, shape, max_in_flight_samples_per_worker=2 * batch)
    ds = ds.batch(batch, drop_remainder=True).take(count // batch)
    start = time.perf_counter()
    got = 0
    for sample_ in ds:
        got += int(sample_.data["tokens"].shape[0])
    assert got == count // batch * batch, (got, count)
    return time.perf_counter() - start


def client_loop(target: str) -> None:
    client = reverb.Client(target)
    rng = np.random.default_rng(0)
    steps = {shape: [step(shape, rng) for _ in range(512)] for shape in SHAPES}
    for line in sys.stdin:
        cmd = json.loads(line)
        shape = cmd["shape"]
        if cmd["op"] in ("push", "legacy"):
            writer = push if cmd["op"] == "push" else legacy_push
            seconds = writer(client, shape, steps[shape], cmd["pushes"], cmd["per"], cmd.get("window", 0))
            count = cmd["pushes"] * cmd["per"]
        elif cmd["op"] == "sample":
            count, seconds = cmd["count"], sample(client, shape, cmd["count"])
        else:
            count, seconds = cmd["count"], dataset(target, shape, cmd["count"], cmd["batch"])
        print(json.dumps({"count": count, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve()
    else:
        client_loop(sys.argv[2])
