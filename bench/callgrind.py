"""Instructions counted with valgrind's callgrind, every thread, around what a benchmark's child
turns counting on for: a count a busy machine does not move, where CPU time moves 1.5x from run to
run (issue 64). Needs valgrind (`apt install valgrind`); PYTHONHASHSEED is fixed, so a tree's count
repeats to 0.1 %.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import results


@contextlib.contextmanager
def counted(*others: int) -> Iterator[None]:
    """In a child `run` started: count the instructions of what runs inside, in this process and in
    the processes `others` it started (`run` with `children`)."""
    toggle = ["callgrind_control", "-i"]
    pids = [str(pid) for pid in (os.getpid(), *others)]
    for pid in pids:
        subprocess.run([*toggle, "on", pid], check=True, capture_output=True)
    yield
    for pid in pids:
        subprocess.run([*toggle, "off", pid], check=True, capture_output=True)


def run(script: str, args: list[str], tree: Path | None = None, *, children: bool = False) -> tuple[int, str]:
    """The instructions `script` run with `args` counted (where it turned counting on: `counted`),
    and its stderr. With `tree`, another checkout's `server/` and `client/` are imported in place of
    these (its compiled modules where it has them built), with this tree's interpreter. With
    `children`, the processes it starts run under callgrind too (counted where `counted` names them)."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        if tree is not None:  # its packages first on the path: a namespace of links to its own
            package = Path(out) / "pkg" / "expbuf"
            package.mkdir(parents=True)
            for name in ("server", "client"):
                (package / name).symlink_to(tree.resolve() / name)
            env["PYTHONPATH"] = str(package.parent)
        done = subprocess.run(
            [
                "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
                f"--trace-children={'yes' if children else 'no'}", sys.executable, script, *args,
            ],
            capture_output=True, env=env,
        )  # fmt: skip
        stderr = done.stderr.decode(errors="replace")
        if done.returncode:
            raise SystemExit(stderr[-3000:])
        total = 0
        for path in Path(out).glob("cg.*"):
            found = re.search(rb"^totals: (\d+)", path.read_bytes(), re.MULTILINE)
            total += int(found.group(1)) if found else 0
        return total, stderr


def compare(
    heading: str,
    about: str,
    key: str,
    cases: Sequence[str],
    count: Callable[[str, Path | None], float],
    before: Path | None,
    out: Path | None,
) -> None:
    """Each case's instructions an experience (`count(case, tree)`, this tree's with None), beside
    `before`'s where it names another checkout: printed as counted, and published under `heading`."""
    rows = []
    for case in cases:
        now = count(case, None)
        if before is None:
            rows.append(f"| {case} | {now:,.0f} |")
        else:
            was = count(case, before)
            rows.append(f"| {case} | {was:,.0f} | {now:,.0f} | **{was / now:.3f}x** |")
        print(rows[-1], flush=True)
    columns = [key, "instructions an experience"]
    if before is not None:
        columns = [key, f"before ({before.name})", "now", "before / now"]
    command = " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    results.publish(results.section(heading, command, about, columns, rows), heading, out)
