"""What the checks of a data directory cost: a Store's open (which refuses a damaged directory)
and `expbuf check`, on directories of 40 KB experiences of growing size.

    .venv/bin/python bench/bench_open.py [--groups 250 500 1000] [--rounds 3] [--out bench/RESULTS.md]

Each directory holds groups of 8 experiences of about 40 KB (bench_store.experience). The open
is timed in this process after one warm-up open (the file is then in the page cache, as after
a restart of the server on a healthy machine); `expbuf check` is timed as the command, with its
interpreter's start-up. Medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

GROUP = 8


def fill(data: Path, groups: int) -> int:
    """A directory with `groups` ready groups; its data.mdb's size."""
    with Store(data) as store:
        store.create_table(TableConfig.of(name="t", group_size=GROUP, estimator="none"))
        for task in range(groups):
            store.put("t", [trxp.from_experience(experience(0, task, run)) for run in range(GROUP)])
    return (data / "data.mdb").stat().st_size


def timed(action: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for groups in args.groups:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            size = fill(data, groups)
            Store(data).close()  # warm-up
            opened = timed(lambda data=data: Store(data).close(), args.rounds)
            command = [sys.executable, "-m", "expbuf.server.cli", "check", "--data", str(data)]
            checked = timed(lambda command=command: subprocess.run(command, check=True, capture_output=True), 1)
        mb = size / 1e6
        rows.append(
            f"| {groups * GROUP:,} | {mb:,.0f} MB | {opened:.2f} s ({mb / opened:,.0f} MB/s) | {checked:.2f} s |"
        )
        print(rows[-1], flush=True)
    section = (
        "## Checks of a data directory: open and `expbuf check`\n\n"
        "`python bench/bench_open.py`: a Store's open, which checks every record, digest, index and\n"
        "counter before a server serves the directory, and the `expbuf check` command (with its\n"
        "interpreter's start-up), on directories of 40 KB experiences in the page cache; medians.\n\n"
        "| experiences | data.mdb | open | `expbuf check` |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    if args.out:
        write_section(args.out, "## Checks of a data directory", section)


if __name__ == "__main__":
    main()
