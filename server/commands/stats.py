"""`expbuf stats`: a terminal view of a running server through the Stats RPC.

For an operator without Grafana: every table's experiences and groups by state, bytes, keyed
values (how many, and their bytes), the oldest experience's age, the policy versions seen, the
background scrub's progress and last complete pass, and (with --watch) push and sample rates
between refreshes. Watched on a terminal, each refresh is drawn over the last, as `top` draws;
into a pipe or a file, each is appended as plain text.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from expbuf.client import BufferClient, BufferError, ScrubInfo, ServerInfo, TableStats, Tls

COLUMNS = (
    "table",
    "pending",
    "computing",
    "ready",
    "leased",
    "consumed",
    "groups p/c/r/l",
    "failed",
    "quarantined",
    "dropped",
    "bytes",
    "values",
    "oldest",
    "versions",
    "push/s",
    "sample/s",
)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _row(name: str, t: TableStats, rates: dict[str, tuple[float, float]]) -> tuple[str, ...]:
    versions = "-" if t.max_model_version < 0 else f"{t.min_model_version}..{t.max_model_version}"
    push, sample = rates.get(name, (None, None))
    cells = (
        name,
        t.pending,
        t.computing,
        t.ready,
        t.leased,
        t.consumed,
        f"{t.groups_pending}/{t.groups_computing}/{t.groups_ready}/{t.groups_leased}",
        t.groups_failed,
        t.quarantined,
        t.groups_dropped,
        _size(t.bytes),
        f"{t.values} ({_size(t.value_bytes)})" if t.values else "-",
        _age(t.oldest_age_seconds) if t.live else "-",
        versions,
        "-" if push is None else f"{push:.1f}",
        "-" if sample is None else f"{sample:.1f}",
    )
    return tuple(str(c) for c in cells)


def scrub_line(scrub: ScrubInfo, now: float) -> str:
    """The background scrub in one line: the pass under way, what it found, the last complete pass."""
    if not scrub.mb_per_second:
        line = "scrub off"
    elif scrub.running:
        line = (
            f"scrub {scrub.progress:.0%} ({_size(scrub.pass_checked_bytes)} of {_size(scrub.pass_total_bytes)},"
            f" at most {scrub.mb_per_second:g} MB/s)"
        )
    else:
        line = f"scrub idle (at most {scrub.mb_per_second:g} MB/s, every {_age(scrub.interval_seconds)})"
    line += f", found {scrub.found} damaged since the start"
    if scrub.last_pass_end_unix:
        line += (
            f"; last complete pass {_age(max(0.0, now - scrub.last_pass_end_unix))} ago"
            f" ({_size(scrub.last_pass_bytes)} in {_age(scrub.last_pass_seconds)}, {scrub.last_pass_found} found)"
        )
    else:
        line += "; no complete pass yet"
    return line


def _advantages(info: ServerInfo) -> str:
    """Where advantages are computed, or why they cannot be, or that nothing has needed them yet."""
    if info.advantage_worker_failure:
        return f"advantages cannot be computed ({info.advantage_worker_failure})"
    if info.advantage_worker_state == "not_needed":
        return "advantages not needed yet (torch not loaded)"
    return f"advantages on {info.advantage_device or 'a device not known yet'}"


def rates_between(
    before: Mapping[str, TableStats], now: Mapping[str, TableStats], elapsed: float
) -> dict[str, tuple[float, float]]:
    """Each table's pushes and samples a second over `elapsed` seconds; none for a table whose
    counters went back (dropped and made again under its name, which showed negative rates)."""
    rates = {}
    for name, t in now.items():
        old = before.get(name)
        if old is not None and t.pushed >= old.pushed and t.sampled >= old.sampled:
            seconds = max(1e-9, elapsed)
            rates[name] = ((t.pushed - old.pushed) / seconds, (t.sampled - old.sampled) / seconds)
    return rates


def render(info: ServerInfo, tables: Mapping[str, TableStats], rates: dict[str, tuple[float, float]]) -> str:
    """The view as text; each column as wide as its widest cell, so long table names keep the columns aligned."""
    rows = [(name, _row(name, t, rates)) for name, t in tables.items()]
    widths = [max([len(header), *(len(cells[i]) for _, cells in rows)]) for i, header in enumerate(COLUMNS)]
    lines = [
        f"expbuf {info.version}  uptime {_age(info.uptime_seconds)}  storage {_size(info.storage_bytes)}"
        f" (map {info.lmdb_map_used_ratio:.0%})  {_advantages(info)}",
        scrub_line(info.scrub, time.time()),
        "",
        "  ".join(header.ljust(w) for header, w in zip(COLUMNS, widths, strict=True)).rstrip(),
    ]
    for name, cells in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if tables[name].last_failure:
            lines.append(f"  last failure: {tables[name].last_failure}")
    return "\n".join(lines)


# ANSI/VT100 sequences: the cursor home, erase to the end of the line, erase below the cursor, erase the screen.
HOME, ERASE_LINE, ERASE_BELOW, ERASE_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"


def redraw(text: str, first: bool, size: tuple[int, int]) -> str:
    """The view drawn over the one before it, on a terminal of `size` (columns, lines): from the
    top, each line cut to the width and cleared to its end, the rest of the screen cleared; at
    most one line less than the terminal holds, so that nothing scrolls. The first clears the
    screen once (as `clear` does); after it the screen only changes where the view does."""
    columns, rows = size
    lines = text.split("\n")
    if len(lines) > rows - 1:
        lines = [*lines[: max(0, rows - 2)], f"... {len(lines) - rows + 2} more line(s): a taller terminal shows them"]
    body = "".join(line[:columns] + ERASE_LINE + "\n" for line in lines)
    return (ERASE_SCREEN if first else "") + HOME + body + ERASE_BELOW


def watch(
    target: str,
    token: str | None,
    interval: float,
    count: int = 0,
    out: TextIO = sys.stdout,
    *,
    tls: Tls | None = None,
) -> int:
    """Print the view once, or every `interval` seconds (`count` times, 0 = until Ctrl-C)."""
    previous: tuple[float, Mapping[str, TableStats]] | None = None
    shown = 0
    with BufferClient(target, token=token, tls=tls, timeout=10, retries=0) as client:
        try:
            while True:
                try:
                    info, tables = client.server_info(), client.stats()
                except BufferError as exc:
                    print(f"expbuf stats: {target}: {exc}", file=sys.stderr)
                    return 1
                now = time.monotonic()
                rates = {} if previous is None else rates_between(previous[1], tables, now - previous[0])
                view = render(info, tables, rates)
                if interval and out.isatty():
                    out.write(redraw(view, not shown, shutil.get_terminal_size()))
                else:
                    out.write(view + "\n")
                out.flush()
                shown += 1
                previous = (now, tables)
                if not interval or (count and shown >= count):
                    return 0
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
