"""`expbuf dataset create|list|describe|export`: a table's datasets of prompts from a shell, through
the RPCs.

Settings are `KEY=VALUE` as for `expbuf table create` (each value read as TOML). `describe` and
`export` page through ListPrompts, so the server reads one bounded page at a time for them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from expbuf.client import BufferClient
from expbuf.client.schema.prompts import STATES, DatasetInfo, Prompt

from .out_file import export_file
from .tables import columns, parse_setting, parse_settings, toml_value

PAGE = 1000  # prompt records a ListPrompts call reads


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _settings(info: DatasetInfo) -> dict[str, object]:
    """What the creator chose (seed None: index order)."""
    return {
        "size": info.size,
        "epochs": info.epochs,
        "seed": info.seed,
        "max_in_flight": info.max_in_flight,
        "on_drop": info.on_drop,
        "max_attempts": info.max_attempts,
        "pass_threshold": info.pass_threshold,
        "order": info.order,
        "order_options": info.order_options,
        "zero_variance": info.zero_variance,
        "skip_epochs": info.skip_epochs,
    }


def _cursor(info: DatasetInfo, short: bool) -> str:
    """The next new prompt's epoch and position in it, or the end once every epoch went out."""
    if info.cursor_epoch >= info.epochs:
        return "end" if short else "end (every epoch handed out)"
    if short:
        return f"{info.cursor_epoch}:{info.cursor_position}"
    return f"epoch {info.cursor_epoch}, position {info.cursor_position}"


def _create(args: argparse.Namespace, client: BufferClient) -> int:
    own = {"table": "the TABLE argument", "name": "the NAME argument", "size": "the SIZE argument"}
    own["exist_ok"] = "--exist-ok"
    settings = parse_settings(args.settings, own)  # a SettingError is a ValueError: exit code 2
    size = parse_setting(f"size={args.size}")[1]
    info = client.create_dataset(args.table, args.name, size, exist_ok=args.exist_ok, **settings)
    shown = " ".join(f"{key}={toml_value(value)}" for key, value in _settings(info).items() if value is not None)
    print(f"dataset {info.name} on table {args.table}: {shown}")
    return 0


def _list(args: argparse.Namespace, client: BufferClient) -> int:
    rows: list[tuple[str, ...]] = [("dataset", "size", "epochs", *STATES, "cursor", "done")]
    for info in client.datasets(args.table):
        counts = (str(info.total(state)) for state in STATES)
        done = "yes" if info.done else "no"
        rows.append((info.name, str(info.size), str(info.epochs), *counts, _cursor(info, short=True), done))
    print(columns(rows))
    return 0


def _describe(args: argparse.Namespace, client: BufferClient) -> int:
    states = [state for given in args.states or () for state in given.split(",") if state]
    unknown = [state for state in states if state not in STATES]
    if unknown:
        raise ValueError(f"--states {','.join(unknown)}: expected some of {', '.join(STATES)}")
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: the prompts to show, 0 or more")
    info = client.ledger(args.table, args.name)
    lines = [f"dataset {info.name} on table {args.table}"]
    for key, value in _settings(info).items():
        lines.append(f"{key} = {'unset (index order)' if value is None else toml_value(value)}")
    if info.shards:
        lines.append(f"shards = {toml_value(info.shards)}")
    if info.shard:  # one shard's part, counted epoch by epoch as each starts
        lines.append(f"owned = {info.owned} (the prompts this shard hands out of the epochs it started)")
    lines += [
        f"created = {_utc(info.created)}",
        f"cursor = {_cursor(info, short=False)}",
        f"reissued = {info.reissued}",
        f"attempts_dropped = {info.attempts_dropped}",
        f"skipped = {info.skipped}",
        f"done = {toml_value(info.done)}",
    ]
    epochs: list[tuple[str, ...]] = [("epoch", *STATES)]
    epochs += [(str(epoch), *(str(getattr(row, state)) for state in STATES)) for epoch, row in enumerate(info.counts)]
    if len(info.counts) < info.epochs:  # the epochs not started, in one row: every prompt pending
        later = info.total("pending") - sum(row.pending for row in info.counts)
        first, last = len(info.counts), info.epochs - 1
        shown = "-" if info.shard else str(later)  # a shard's part of an epoch is counted when it starts
        epochs.append((str(first) if first == last else f"{first}..{last}", shown, *"0000"))
    sections = ["\n".join(lines), columns(epochs)]
    if args.limit:
        prompts, more = _prompts(client, args.table, args.name, states, args.limit)
        rows: list[tuple[str, ...]] = [
            ("epoch", "index", "attempt", "state", "group", "owner", "expires", "runs", "pass_rate", "last_mean")
        ]
        rows += [_row(p) for p in prompts]
        sections.append(columns(rows) + ("\n(more prompts: raise --limit)" if more else ""))
    print("\n\n".join(sections))
    return 0


def _prompts(client: BufferClient, table: str, name: str, states: list[str], limit: int) -> tuple[list[Prompt], bool]:
    """Up to `limit` prompts of the states asked for, in (epoch, index) order, a page at a
    time; and whether there are more."""
    shown: list[Prompt] = []
    after = None
    while len(shown) <= limit:
        page = client.list_prompts(table, name, states=states, after=after, limit=PAGE)
        shown += page.prompts
        if page.done:
            break
        after = page.after
    return shown[:limit], len(shown) > limit


def _row(prompt: Prompt) -> tuple[str, ...]:
    expires = _utc(prompt.expires) if prompt.state == "claimed" else "-"
    stats = prompt.stats
    runs = str(stats.runs) if stats is not None else "-"
    rate = f"{stats.pass_rate:.3f}" if stats is not None and stats.runs else "-"
    mean = f"{stats.last_mean:.3f}" if stats is not None and stats.last_runs else "-"
    return (
        str(prompt.epoch), str(prompt.index), str(prompt.attempt), prompt.state, prompt.group,
        prompt.owner or "-", expires, runs, rate, mean,
    )  # fmt: skip


def _export(args: argparse.Namespace, client: BufferClient) -> int:
    """Every prompt handed out, one JSON object a line: where it stands and its statistics (the
    prompt's over its epochs, on each epoch's line; NaN as null, infinities as "inf" and "-inf").
    A file that cannot be written is one line, exit code 2."""
    page = client.list_prompts(args.table, args.name, limit=PAGE)  # an unknown dataset: no file is left behind
    with contextlib.ExitStack() as stack:
        try:  # written beside --out, put in its place once whole: a failed export leaves an earlier file
            made = export_file(args.out, binary=False)
        except OSError as exc:
            print(f"expbuf dataset export: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        out = sys.stdout if made is None else stack.enter_context(made)
        written = 0
        while True:
            for prompt in page.prompts:
                out.write(json.dumps(_exported(prompt), allow_nan=False) + "\n")
                written += 1
            if page.done:
                break
            page = client.list_prompts(args.table, args.name, after=page.after, limit=PAGE)
        if made is not None:
            made.whole = True
    print(f"{written} prompts of dataset {args.name}", file=sys.stderr)
    return 0


def _exported(prompt: Prompt) -> dict[str, object]:
    row: dict[str, object] = {key: _number(value) for key, value in asdict(prompt).items() if key != "stats"}
    if prompt.stats is not None:
        stats = {**asdict(prompt.stats), "pass_rate": prompt.stats.pass_rate}
        row["stats"] = {key: _number(value) for key, value in stats.items()}
    return row


def _number(value: object) -> object:
    """A value as strict JSON holds it: NaN (no value yet) as null, an infinity (a mean or
    variance of rewards past float's range) as "inf" or "-inf", as `expbuf export` writes it;
    json.dumps would write NaN and Infinity, which a strict parser refuses."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def add_dataset_commands(
    sub: argparse._SubParsersAction,
    client_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Register `expbuf dataset ...` under the top-level parser; `run` connects and calls the action."""
    dataset = sub.add_parser("dataset", help="create, list or describe the datasets of prompts of a running server")
    actions = dataset.add_subparsers(dest="action", required=True, help="what to do with datasets")
    create = actions.add_parser("create", help="create a dataset of SIZE prompts on a table that groups by task")
    create.add_argument("table", help="the table's name")
    create.add_argument("name", help="the dataset's name")
    create.add_argument("size", help="prompts per epoch (indexes 0..SIZE-1)")
    create.add_argument(
        "settings",
        nargs="*",
        metavar="KEY=VALUE",
        help=(
            "epochs, seed, max_in_flight, on_drop (done or retry), max_attempts, pass_threshold, order"
            " (permutation, pools or pass_rate), order_options, zero_variance (keep, retry or skip), skip_epochs;"
            " e.g. epochs=3 seed=7 order=pools order_options={easy_share=0.2}"
        ),
    )
    create.add_argument("--exist-ok", action="store_true", help="succeed if the dataset exists with these settings")
    create.set_defaults(run_action=_create)
    listing = actions.add_parser("list", help="a table's datasets: prompts by state, cursor, done")
    listing.add_argument("table", help="the table's name")
    listing.set_defaults(run_action=_list)
    describe = actions.add_parser(
        "describe", help="a dataset's settings, cursor, counts per epoch and state, and its prompts"
    )
    describe.add_argument("table", help="the table's name")
    describe.add_argument("name", help="the dataset's name")
    describe.add_argument(
        "--states",
        action="append",
        metavar="STATE[,STATE]",
        help=f"list only prompts in these states ({', '.join(STATES)}); repeatable",
    )
    describe.add_argument(
        "--limit", type=int, default=100, help="prompts to list at most, 0 for none (default %(default)s)"
    )
    describe.set_defaults(run_action=_describe)
    export = actions.add_parser(
        "export", help="a dataset's prompts handed out, with their statistics, as JSON lines (for a curriculum's look)"
    )
    export.add_argument("table", help="the table's name")
    export.add_argument("name", help="the dataset's name")
    export.add_argument("--out", help="file to write (default: standard output)")
    export.set_defaults(run_action=_export)
    for parser in (create, listing, describe, export):
        client_options(parser)
        parser.set_defaults(func=run)
