"""Instructions the server's ingest of a push costs an experience (valgrind's callgrind, counted
around each part alone): the parse of a pushed payload (`trxp.parse`: every check on untrusted
bytes), the packing of each experience as the store keeps it (`pack_item`: its canonical metadata
pickle, header and frame), its digest (`digests.of`), its generated tokens (`generated_tokens`: its
action mask's count) and the entry made of it (`Entry.staged`): together what `Entry.of` does to
each, most of what a push of small experiences costs the server (issue 64). Apart from them, `pool`:
a push handed to an ingest process and its entries taken back (ingest.py's `_Worker.entries`, as a
push that overlaps another's decode takes it), the server's process and the worker's counted.

    .venv/bin/python bench/bench_ingest_instructions.py [--shapes 8k,40k] [--before TREE] [--out bench/RESULTS.md]

bench_reverb's experiences, 256 of 8 KB or 64 of 40 KB a push, eight pushes encoded by the client
beforehand. `--before TREE` counts another checkout's codec and store beside this one's (its
`server/` and `client/` imported in place of these, its compiled modules where it has them built).
Needs valgrind (callgrind.py).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import callgrind  # noqa: E402
import results  # noqa: E402

PARTS = ("parse", "pack", "digest", "generated", "entry")
POOL = "pool"
HEADING = "## Instructions of a push's ingest (issue 64)"


def child(part: str, shape: str) -> None:
    """Under callgrind, collection off: `part` over every experience counted with it on."""
    from bench_reverb import make_pushes

    from expbuf.client import trxp
    from expbuf.client.trxp.codec.build import pack_item
    from expbuf.server.store import Entry
    from expbuf.server.store.disk import digests

    payloads = [trxp.encode(push) for push in make_pushes(shape, 8)]
    items = [item for payload in payloads for item in trxp.parse(payload)]
    blobs = [pack_item(item) for item in items]
    # What the process holds by now is out of the collector's sight, as a server's loaded objects
    # are (server/advantages/start.freeze_loaded): a full collection that falls inside the count
    # walks what the counted part makes, not the bench's items and payloads.
    gc.collect()
    gc.freeze()
    if part == POOL:
        pool(payloads)
        print(f"experiences {len(items)}", file=sys.stderr)
        return
    with callgrind.counted():
        if part == "parse":
            for payload in payloads:
                trxp.parse(payload)
        elif part == "pack":
            for item in items:
                pack_item(item)
        elif part == "digest":
            for blob in blobs:
                digests.of(blob)
        elif part == "generated":
            for item in items:
                item.generated_tokens  # noqa: B018 (a property: what is counted is its reading)
        else:
            for item, blob in zip(items, blobs, strict=True):
                Entry.staged(item, blob, b"", len(blob), 0)
    print(f"experiences {len(items)}", file=sys.stderr)


def pool(payloads: list[bytes]) -> None:
    """Each payload decoded by an ingest process (started under callgrind, and ready), counted in
    both processes; a push before them maps the shared region, grown to its size on both sides."""
    from expbuf.server.config import ServerConfig
    from expbuf.server.rpc.push.ingest import _Worker

    worker = _Worker(ServerConfig.max_metadata_bytes)
    try:
        worker.ready()
        worker.entries(payloads[0])
        with callgrind.counted(worker.process.pid):
            for payload in payloads:
                worker.entries(payload)
    finally:
        worker.close()


def instructions(part: str, shape: str, tree: Path | None) -> float:
    """Instructions an experience of `part`, this tree's or `tree`'s."""
    args = ["--child", part, "--shapes", shape]
    total, stderr = callgrind.run(__file__, args, tree, children=part == POOL)
    counted = re.search(r"^experiences (\d+)$", stderr, re.MULTILINE)
    if counted is None:
        raise SystemExit(stderr[-3000:])
    return total / int(counted.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8k,40k")
    parser.add_argument("--before", type=Path, help="another checkout counted beside this one")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=(*PARTS, POOL), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.shapes)
        return
    rows = []
    for shape in args.shapes.split(","):
        counted = (*PARTS, POOL)
        now = {part: instructions(part, shape, None) for part in counted}
        before = {part: instructions(part, shape, args.before) for part in counted} if args.before else None
        for part in (*PARTS, "together", POOL):
            after = sum(now[part] for part in PARTS) if part == "together" else now[part]
            if before is None:
                rows.append(f"| {shape} | {part} | {after:,.0f} |")
                continue
            was = sum(before[part] for part in PARTS) if part == "together" else before[part]
            rows.append(f"| {shape} | {part} | {was:,.0f} | {after:,.0f} | **{was / after:.3f}x** |")
        print("\n".join(rows[-len(PARTS) - 2 :]), flush=True)
    columns = ["shape", "part", "instructions an experience"]
    if args.before is not None:
        columns = ["shape", "part", f"before ({args.before.name})", "now", "before / now"]
    about = (
        "callgrind, every thread; eight pushes of bench_reverb's experiences, each part counted alone "
        "(together: the parts before it; pool: apart, both processes)."
    )
    command = "python bench/bench_ingest_instructions.py " + " ".join(sys.argv[1:])
    results.publish(results.section(HEADING, command, about, columns, rows), HEADING, args.out)


if __name__ == "__main__":
    main()
