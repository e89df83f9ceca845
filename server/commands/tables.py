"""`expbuf table create|list|describe|drop|reset-offpolicy`: table administration from a shell, through the RPCs.

Settings are given as `KEY=VALUE` with the TOML names and TOML values (`group_size=8`,
`estimator=grpo`, `shaping={reward_clip=5.0}`), over a preset's with `--preset NAME`, and
`describe` prints a table's settings as the `[[tables]]` block of a TOML config, so what an
operator reads can be pasted into one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from expbuf.client import BufferClient, BufferError, Tls
from expbuf.client.schema.table_presets import PRESETS


class SettingError(ValueError):
    """A `KEY=VALUE` argument that is not one."""


def parse_setting(text: str) -> tuple[str, Any]:
    """`KEY=VALUE`, the value read as TOML (a bare word that is not TOML is a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise SettingError(f"{text!r}: a setting is KEY=VALUE, e.g. group_size=8")
    try:
        return key.strip(), tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value


def parse_settings(texts: list[str], own: dict[str, str]) -> dict[str, Any]:
    """`KEY=VALUE` arguments as settings; a key that is one of the command's own arguments
    (`own`: the key -> the argument or option that gives it) is refused naming that argument,
    where it would reach the call twice, and a key given twice naming both, where the last
    would be taken without a word."""
    settings: dict[str, Any] = {}
    given: dict[str, str] = {}
    for text in texts:
        key, value = parse_setting(text)
        if key in own:
            raise SettingError(f"{text!r}: not a setting; {key} is given as {own[key]}")
        if key in given:
            raise SettingError(f"{key} is given twice ({given[key]!r} and {text!r}); give it once")
        settings[key] = value
        given[key] = text
    return settings


def toml_value(value: Any) -> str:
    """A value as TOML writes it: strings quoted, booleans in lower case, tables inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def describe_text(settings: dict[str, Any], stats: dict[str, Any]) -> str:
    """Settings as a `[[tables]]` block (unset ones left out), then the table's counts as comments."""
    lines = ["[[tables]]"]
    lines += [f"{key} = {toml_value(value)}" for key, value in settings.items() if value is not None]
    lines += ["", "# stats"]
    lines += [f"# {key} = {value}" for key, value in stats.items() if key != "name"]
    return "\n".join(lines)


def columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _create(args: argparse.Namespace, client: BufferClient) -> int:
    own = {"name": "the NAME argument", "exist_ok": "--exist-ok", "preset": "--preset NAME"}
    settings = parse_settings(args.settings, own)  # a SettingError is a ValueError: exit code 2
    created = client.create_table(args.name, exist_ok=args.exist_ok, preset=args.preset, **settings)
    print(describe_text(created.settings(), {}).split("\n\n")[0])
    return 0


def _list(args: argparse.Namespace, client: BufferClient) -> int:
    stats = client.stats()
    rows: list[tuple[str, ...]] = [
        ("table", "group_by", "group_size", "estimator", "ready", "leased", "pending", "computing")
    ]
    for t in client.list_tables():  # computing: an estimator failing shows here, not as an empty table
        s = stats.get(t.name)
        counts = ("-",) * 4 if s is None else (str(s.ready), str(s.leased), str(s.pending), str(s.computing))
        rows.append((t.name, t.group_by, str(t.group_size), t.estimator, *counts))
    print(columns(rows))
    return 0


def _describe(args: argparse.Namespace, client: BufferClient) -> int:
    table = next((t for t in client.list_tables() if t.name == args.name), None)
    if table is None:
        print(f"expbuf table describe: no table {args.name!r}", file=sys.stderr)
        return 1
    stats = client.stats(args.name).get(args.name)
    print(describe_text(table.settings(), {} if stats is None else asdict(stats)))
    return 0


def _drop(args: argparse.Namespace, client: BufferClient) -> int:
    if not args.yes:
        print(
            f"expbuf table drop: dropping {args.name!r} deletes every experience it holds; add --yes to do it",
            file=sys.stderr,
        )
        return 2
    print(f"dropped {args.name}: {client.drop_table(args.name)} experiences")
    return 0


def _reset(args: argparse.Namespace, client: BufferClient) -> int:
    if args.version is not None and args.version < 0:
        print(f"expbuf table reset-offpolicy: --version must be >= 0, got {args.version}", file=sys.stderr)
        return 2
    reset = client.reset_offpolicy(args.name, args.version)
    version = reset["trainer_version"]
    print(
        f"table {args.name}: trainer version {'unset' if version < 0 else version}, "
        f"{reset['submitted']} rollouts of open grants counted"
    )
    return 0


def add_table_commands(
    sub: argparse._SubParsersAction,
    client_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Register `expbuf table ...` under the top-level parser; `run` connects and calls the action."""
    table = sub.add_parser("table", help="create, list, describe or drop tables of a running server")
    actions = table.add_subparsers(dest="action", required=True, help="what to do with tables")
    create = actions.add_parser("create", help="create a table (settings as in a TOML [[tables]] block)")
    create.add_argument("name", help="the table's name")
    create.add_argument("settings", nargs="*", metavar="KEY=VALUE", help="settings, e.g. group_size=8 estimator=grpo")
    create.add_argument("--exist-ok", action="store_true", help="succeed if a table with these settings exists")
    create.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="start from a common table's settings (queue, replay, trinity); the settings given win over them",
    )
    create.set_defaults(run_action=_create)
    listing = actions.add_parser("list", help="every table with its grouping, estimator and counts")
    listing.set_defaults(run_action=_list)
    describe = actions.add_parser("describe", help="a table's settings as TOML, and its counts")
    describe.add_argument("name", help="the table's name")
    describe.set_defaults(run_action=_describe)
    drop = actions.add_parser("drop", help="drop a table and every experience in it")
    drop.add_argument("name", help="the table's name")
    drop.add_argument("--yes", action="store_true", help="really drop it (the command refuses without)")
    drop.set_defaults(run_action=_drop)
    reset = actions.add_parser(
        "reset-offpolicy",
        help="set a table's trainer version back (or unset it) and forget the rollouts admission counted,"
        " for a job that starts over (admin scope)",
    )
    reset.add_argument("name", help="the table's name")
    reset.add_argument("--version", type=int, help="the trainer version to set (default: unset, as a new table)")
    reset.set_defaults(run_action=_reset)
    for parser in (create, listing, describe, drop, reset):
        client_options(parser)
        parser.set_defaults(func=run)


def run_client_command(args: argparse.Namespace, tls: Tls | None) -> int:
    """Run one action of `expbuf table` or `expbuf dataset` (`args.run_action`); a refusal by
    the server is its status, reason and message, exit code 1, and a mistake the client catches before
    it calls (a setting it does not know, a value its field cannot take) is that message, exit
    code 2."""
    with BufferClient(args.target, token=args.token, tls=tls, timeout=30, retries=0) as client:
        try:
            return args.run_action(args, client)
        except BufferError as exc:
            why = f" ({exc.reason})" if exc.reason else ""  # what a script acts on, as code reads ExpbufError.reason
            print(f"expbuf {args.command} {args.action}: {exc.code.name}{why}: {exc.details}", file=sys.stderr)
            return 1
        except ValueError as exc:  # the client's own checks of what it was given (wire.WireError, ...)
            print(f"expbuf {args.command} {args.action}: {exc}", file=sys.stderr)
            return 2
