"""What the garbage collector costs a trainer's decode, and what `gc.freeze()` gives back (issues 32, 64).

    .venv/bin/python bench/bench_gc_decode.py [--rounds 5] [--batches 60] [--stream-pushes 64]
        [--out bench/RESULTS.md]

One sampled reply of 256 x 8 KB experiences (bench_reverb's shape, built in this process: no
server, the decode alone) is decoded `--batches` times with every experience's tensors read, as
`Batch.experiences` does for a trainer, in this process's CPU time per experience:
- with the collector as it runs by default, in a process holding torch and the bench's pushes
  (about 280 k tracked objects, fewer than a trainer with its model and framework loaded): the
  decode holds the collector's passes off while it runs (client/trxp/codec/gc_pause.py);
- the same decode without that pause (its parse and its experiences made as `decode_reply`
  makes them), the decode as it was before it;
- the same after `gc.freeze()` (what the process holds is left out of every collection);
- the same with the collector off (the floor).
The time each generation's collections took is read from `gc.callbacks` in the default run.
Medians of the rounds, the four in alternating order within each round.

Then a trainer's consume stream end to end: a real `expbuf serve` filled with `--stream-pushes`
pushes of 256 x 8 KB experiences, drained by one consume stream of batches of 256 read as
`Batch.experiences` (prefetch 1, the client's default), with the decode's pause and without it,
alternating round by round; this process's CPU per experience and the drain's rate.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes, restamp, uptime  # noqa: E402
from bench_service import drain, serving  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.client.trxp.codec import convert  # noqa: E402
from expbuf.client.trxp.codec.common import UNBOUNDED, Work  # noqa: E402
from expbuf.client.trxp.codec.convert import decode_reply  # noqa: E402
from expbuf.client.trxp.codec.measure import Shape  # noqa: E402
from expbuf.client.trxp.codec.parse import parse  # noqa: E402

HEADING = "## A trainer's garbage collector and the decode (issue 32)"


class Collections:
    """Seconds spent in collections, by generation, while installed in gc.callbacks."""

    def __init__(self) -> None:
        self.spent = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.spent[info["generation"]] += time.perf_counter() - self._start


def unpaused(payload: bytes) -> list:
    """`decode_reply` without its pause of the collector."""
    view = memoryview(payload)
    work = Work.for_payload(len(view))
    shape = Shape(work, UNBOUNDED, check_keys=False, containers_of=convert._WALKED)
    return convert._experiences(parse(view, work=work, shape=shape), view)


def decode_us(payload: bytes, batches: int, decode: Callable[[bytes], list] = decode_reply) -> float:
    """CPU µs per experience of decoding `payload` `batches` times, each experience's tensors read."""
    start = time.process_time()
    count = 0
    for _ in range(batches):
        for exp in decode(payload):  # an experience's tokens read (a TensorDict's are left as made)
            tokens = getattr(exp, "tokens", None)
            count += 1 if tokens is None else tokens.numel() > 0
    return (time.process_time() - start) / count * 1e6


def trinity_decode() -> Callable[[bytes], list] | None:
    """Trinity-RFT's `Experience.deserialize_many`, which expbuf's Trinity reader decodes with, if
    trinity-rft is installed."""
    try:
        from trinity.common.experience import Experience
    except ImportError:
        return None
    return Experience.deserialize_many


def torchrl_elements() -> Callable[[bytes], list] | None:
    """The TorchRL storage's decode of a drawn batch: its experiences, then a TensorDict each
    (`convert.to_elements`, which ExpbufStorage.hold makes under the pause), if torchrl is installed."""
    try:
        from tensordict import set_list_to_stack

        from expbuf.client.torchrl import convert as torchrl_convert
    except ImportError:
        return None

    def elements(payload: bytes) -> list:
        experiences = decode_reply(payload)
        with set_list_to_stack(True):
            return torchrl_convert.to_elements(experiences, "query")

    return elements


def paused(decode: Callable[[bytes], list], payload: bytes) -> list:
    """`decode` of `payload` under the pause the Trinity reader holds its decode in."""
    with convert.collector_paused():
        return decode(payload)


def frozen(run: Callable[[], float]) -> float:
    gc.freeze()
    try:
        return run()
    finally:
        gc.unfreeze()


def collector_off(run: Callable[[], float]) -> float:
    gc.disable()
    try:
        return run()
    finally:
        gc.enable()


def stream(pushes: list, rounds: int) -> dict[str, tuple[float, float]]:
    """Client CPU µs per experience and experiences a second of a decoded consume stream, with
    the decode's pause of the collector and without it (medians of the rounds, alternating)."""
    serial = itertools.count()
    results: dict[str, list[tuple[float, float]]] = {"paused": [], "unpaused": []}
    with serving() as server, BufferClient(server.target, timeout=120) as client:
        client.create_table("stream", group_by="none", estimator="none")
        for r in range(2 * rounds + 1):  # the first drain warms up (torch's import, the connection)
            name = ("paused", "unpaused")[r % 2]
            restamp(pushes, serial)
            for exps in pushes:
                client.push(trxp.encode(exps), table="stream")
            kept = convert.collector_paused
            if name == "unpaused":
                convert.collector_paused = contextlib.nullcontext
            try:
                usage = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                got = drain(client, "stream", len(pushes))
                seconds = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
            finally:
                convert.collector_paused = kept
            cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
            if r:
                results[name].append((cpu / got * 1e6, got / seconds))
    return {
        name: (statistics.median(c for c, _ in runs), statistics.median(rate for _, rate in runs))
        for name, runs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--stream-pushes", type=int, default=64, help="pushes of 256 a drain, at most 64 (0: none)")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_gc_decode.py " + " ".join(sys.argv[1:])).strip()
    load = uptime()
    held = make_pushes("8k", 64) + make_pushes("40k", 64)  # what bench_reverb's client holds
    payload = trxp.join([trxp.pack_item(item) for item in trxp.parse(trxp.encode(held[0]))])
    tracked = len(gc.get_objects())

    def run() -> float:
        return decode_us(payload, args.batches)

    kinds: dict[str, Callable[[], float]] = {
        "default": run,
        "unpaused": lambda: decode_us(payload, args.batches, unpaused),
        "frozen": lambda: frozen(run),
        "off": lambda: collector_off(run),
    }
    trinity = trinity_decode()
    if trinity is not None:  # the Trinity reader's decode, Trinity-RFT's own, with its pause and without
        kinds["trinity"] = lambda: decode_us(payload, args.batches, lambda p: paused(trinity, p))
        kinds["trinity unpaused"] = lambda: decode_us(payload, args.batches, trinity)
    torchrl = torchrl_elements()
    if torchrl is not None:  # fewer batches: a TensorDict an experience costs ten times a decode
        kinds["torchrl"] = lambda: decode_us(payload, args.batches // 6 or 1, lambda p: paused(torchrl, p))
        kinds["torchrl unpaused"] = lambda: decode_us(payload, args.batches // 6 or 1, torchrl)
    results: dict[str, list[float]] = {name: [] for name in kinds}
    watches = {name: Collections() for name in kinds}
    for r in range(args.rounds):
        for name in list(kinds)[r % len(kinds) :] + list(kinds)[: r % len(kinds)]:
            watch = watches[name]
            gc.callbacks.append(watch)
            try:
                results[name].append(kinds[name]())
            finally:
                gc.callbacks.remove(watch)
    med = {name: statistics.median(values) for name, values in results.items()}
    streamed = stream(held[: min(args.stream_pushes, 64)], args.rounds) if args.stream_pushes else {}
    per_exp = {
        name: ", ".join(
            f"{generation} {s / (args.rounds * args.batches * 256) * 1e6:.1f}"
            for generation, s in zip(("young", "middle", "full"), watch.spent, strict=True)
        )
        for name, watch in watches.items()
        if name in ("default", "unpaused")
    }
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"One process, {tracked:,} tracked objects before the decode (torch and the bench's pushes; "
            f"load average {load} at the start). A reply of 256 x 8 KB experiences decoded {args.batches} "
            f"times a round, each experience's tensors read; CPU µs per experience, medians of {args.rounds} "
            "rounds in alternating order.",
            "",
            "| collector | decode, µs per experience | against the default |",
            "| --- | ---: | ---: |",
            f"| on, as by default (the decode holds its passes off) | {med['default']:.1f} | 1.00 |",
            f"| on, the decode without that pause (as before it) | {med['unpaused']:.1f} "
            f"| {med['unpaused'] / med['default']:.2f} |",
            f"| on, after `gc.freeze()` | {med['frozen']:.1f} | {med['frozen'] / med['default']:.2f} |",
            f"| off (the floor) | {med['off']:.1f} | {med['off'] / med['default']:.2f} |",
            *(
                [
                    f"| Trinity-RFT's `Experience.deserialize_many` (the Trinity reader's decode), paused | "
                    f"{med['trinity']:.1f} | {med['trinity'] / med['default']:.2f} |",
                    f"| Trinity-RFT's `Experience.deserialize_many`, without the pause | "
                    f"{med['trinity unpaused']:.1f} | {med['trinity unpaused'] / med['default']:.2f} |",
                ]
                if "trinity" in med
                else []
            ),
            *(
                [
                    "| TorchRL's elements of the batch (decoded, then `to_elements` as ExpbufStorage makes them), "
                    f"paused | {med['torchrl']:.1f} | {med['torchrl'] / med['default']:.2f} |",
                    "| TorchRL's elements of the batch, without the pause | "
                    f"{med['torchrl unpaused']:.1f} | {med['torchrl unpaused'] / med['default']:.2f} |",
                ]
                if "torchrl" in med
                else []
            ),
            "",
            "Collections, µs per experience decoded, by generation: by default "
            f"{per_exp['default']}; without the pause {per_exp['unpaused']}. Without it, a decoded batch's "
            "objects live through the young collections its own decode brings on, so they reach the oldest "
            "generation, and every few batches that triggers a full collection, which walks everything the "
            "process holds; with it, the decode's passing objects are gone before any pass runs.",
            "",
        ]
    )
    if streamed:
        held_off, ran = streamed["paused"], streamed["unpaused"]
        section += "\n".join(
            [
                "",
                f"A consume stream of {args.stream_pushes * 256:,} experiences of 8 KB from a real `expbuf serve`, "
                "batches of 256 read as `Batch.experiences` (prefetch 1), the decode's pause and none in "
                f"alternating rounds; medians of {args.rounds} rounds each:",
                "",
                "| decode | client CPU µs per experience | experiences a second |",
                "| --- | ---: | ---: |",
                f"| with the pause | {held_off[0]:.1f} | {held_off[1]:,.0f} |",
                f"| without it | {ran[0]:.1f} | {ran[1]:,.0f} |",
                f"| without / with | **{ran[0] / held_off[0]:.2f}** "
                f"| **{held_off[1] / ran[1]:.2f}** (with / without) |",
                "",
            ]
        )
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
