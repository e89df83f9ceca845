"""`expbuf export TABLE`: a running table's live experiences, as JSON lines or one TRXP file.

It pages through ListExperiences and reads each page's payloads with `client.get()` (in parts,
however large), so what it writes carries the advantages the table computed, and the server
never holds more than a page for it. An experience get() does not return (retired since it was listed, or found
damaged and quarantined) is left out and counted, and the export goes on. JSON lines suit
a look with `jq` or pandas; TRXP is what Trinity-RFT's `Experience.deserialize_many` and
`expbuf.client.decode` read.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from typing import Any, BinaryIO, TextIO, cast

from expbuf.client import BufferClient, BufferError, Experience, Tls, encode
from expbuf.client.client import ListedExperience

from .out_file import export_file

# The most bits of an int written as a JSON number: str() of an int refuses more than 4,300 digits
# (Python's bound; 14,000 bits are about 4,215), and one such int in an experience's metadata ended
# the export. A larger one is written as {"hex": its hex}.
_INT_BITS = 14_000


def _plain(value: Any) -> Any:
    """A value JSON can hold: tensors as lists, non-finite floats as strings, bytes (which an
    experience's metadata may hold, TRXP's plain data) as {"base64": their base64}, a bytes key as
    "base64:" and its base64, an int beyond _INT_BITS as {"hex": its hex}: json.dumps raised on
    them, and one such experience ended the export."""
    if hasattr(value, "tolist"):  # a tensor (torch is not imported here: `expbuf health` stays light)
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, int) and value.bit_length() > _INT_BITS:
        return {"hex": hex(value)}
    return value


def _key(key: Any) -> str:
    return "base64:" + base64.b64encode(key).decode() if isinstance(key, bytes) else str(key)


def json_line(listed: ListedExperience, exp: Experience) -> str:
    """One experience as one JSON object: where it stands in the table, then every field."""
    record: dict[str, Any] = {"uid": listed.uid, "group_id": listed.group_id, "state": listed.state}
    record["times_sampled"] = listed.times_sampled
    for f in fields(exp):
        value = getattr(exp, f.name)
        record[f.name] = asdict(value) if f.name == "eid" else _plain(value)
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode()
    except UnicodeEncodeError:  # a lone surrogate (a str TRXP's pickle may hold): escaped, as JSON can
        return json.dumps(record)
    return line


def pages(
    client: BufferClient, args: argparse.Namespace
) -> Iterator[tuple[list[ListedExperience], list[Experience], int]]:
    """Each page's listed experiences with their payloads, and how many listed ones get() did not
    return (retired meanwhile, or quarantined: their payloads found damaged), left out."""
    after = 0
    while True:
        page = client.list_experiences(
            args.table,
            states=args.state or (),
            min_model_version=args.min_version,
            max_model_version=args.max_version,
            after=after,
            limit=args.page,
        )
        if page.experiences:
            got = {e.eid.uid: e for e in client.get([e.uid for e in page.experiences], table=args.table)}
            listed = [e for e in page.experiences if e.uid in got]
            yield listed, [got[e.uid] for e in listed], len(page.experiences) - len(listed)
        if page.done:
            return
        after = page.next


def _export(client: BufferClient, args: argparse.Namespace, out: TextIO | BinaryIO) -> int:
    """Write the pages to `out`: JSON lines as they come, or, for a TRXP file (binary), one batch
    at the end."""
    count = skipped = 0
    collected: list[Experience] = []
    for listed, experiences, left_out in pages(client, args):
        count += len(experiences)
        skipped += left_out
        if args.format == "jsonl":
            cast(TextIO, out).writelines(
                json_line(item, exp) + "\n" for item, exp in zip(listed, experiences, strict=True)
            )
        else:
            collected += experiences
    if args.format == "trxp":
        cast(BinaryIO, out).write(encode(collected))
    note = f" ({skipped} listed but not returned: retired meanwhile, or quarantined as damaged)" if skipped else ""
    print(f"exported {count} experiences of {args.table}{note}", file=sys.stderr)
    return 0


def add_export_command(
    sub: argparse._SubParsersAction,
    client_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    export = sub.add_parser("export", help="write a table's live experiences as JSON lines or a TRXP file")
    export.add_argument("table", help="the table to export")
    export.add_argument("--format", choices=("jsonl", "trxp"), default="jsonl", help="output format (default jsonl)")
    export.add_argument("--out", help="file to write (default: standard output; a TRXP export needs one)")
    export.add_argument(
        "--state", action="append", choices=("pending", "computing", "ready", "leased"),
        help="only experiences in this state (repeatable; default: every live state)",
    )  # fmt: skip
    export.add_argument("--min-version", type=int, help="only experiences of info['model_version'] >= this")
    export.add_argument("--max-version", type=int, help="only experiences of info['model_version'] <= this")
    export.add_argument("--page", type=int, default=1000, help="experiences read per request (default 1000)")
    client_options(export)
    export.set_defaults(func=run)


def run_export(args: argparse.Namespace, tls: Tls | None) -> int:
    """Export; a refusal by the server is its status and message, exit code 1, and a mistake in
    what was asked (no --out for TRXP, a page below 0, a file that cannot be written) one line,
    exit code 2, found before the table is read."""
    if args.format == "trxp" and not args.out:
        print("expbuf export: a TRXP export needs --out FILE (it is binary)", file=sys.stderr)
        return 2
    if not args.table.isprintable() or args.table != args.table.encode("utf-8", "replace").decode():
        print(f"expbuf export: table {args.table!r}: not a table's name (not UTF-8 text)", file=sys.stderr)
        return 2
    if not 0 <= args.page < 1 << 32:
        print(
            f"expbuf export: --page {args.page}: experiences per request, 0 (the server's 1000) or more",
            file=sys.stderr,
        )
        return 2
    for name in ("min_version", "max_version"):
        version = getattr(args, name)
        if version is not None and not -(1 << 63) <= version < 1 << 63:
            print(f"expbuf export: --{name.replace('_', '-')} {version}: past a model version's range", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(BufferClient(args.target, token=args.token, tls=tls, timeout=60))
        try:  # written beside --out, put in its place once whole: a failed export leaves an earlier file
            made = export_file(args.out, binary=args.format == "trxp")
        except OSError as exc:
            print(f"expbuf export: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        out: TextIO | BinaryIO = sys.stdout if made is None else stack.enter_context(made)
        try:
            code = _export(client, args, out)
        except BufferError as exc:
            print(f"expbuf export: {exc.code.name}: {exc.details}", file=sys.stderr)
            return 1
        if made is not None and code == 0:
            made.whole = True
        return code
