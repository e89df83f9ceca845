"""A group's shared prompt stored once: the runs of a GRPO group carry the same prompt tokens,
which a store of whole payloads would keep once a run.

A payload stored whole whose prompt (the first `length - response_length` rows of its
`tokens`) takes at least MIN_BYTES is stored as a reference: b"TRXR" · the prompt's XXH3-128
digest · where its bytes lie in the payload (u64) · their length (u64), then the payload
without them. The prompt's bytes are kept once a table under their digest (`shared`), with
how many stored payloads refer to them (`shared_refs`); a run whose prompt has the digest of
other bytes (never seen, but not assumed away) is stored whole. The comparison is of bytes,
so a prompt is shared by any runs of the table that carry it, in a group or across groups (a
task trained again in the next epoch).

Read back (`resolve`), a reference is a `pieces.SplitPayload`, the same bytes as the payload
stored whole, which the record's digest is taken over: the read check, the scrub, Get, the
splice and the columns work on it as on any payload, and a prompt that is damaged or missing
is found by the check of every run that refers to it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import lmdb

from expbuf.client.trxp.codec.build import json_text
from expbuf.client.trxp.stored.pieces import Bytes, SplitPayload, parts_of, section_at
from expbuf.client.trxp.stored.splice import stored_entries

from . import digests

MIN_BYTES = 1024  # a shorter prompt is stored with its run: the reference costs it a read
REF_MAGIC = b"TRXR"
_REF = struct.Struct("<4s16sQQ")  # magic, the prompt's digest, where its bytes lie, their length
_COUNT = struct.Struct("<Q")
_TOKENS = json_text("tokens")
Read = Callable[[str, bytes], Bytes | None]  # a value of the named database, by key


def is_ref(value: Bytes) -> bool:
    return value[:4] == REF_MAGIC


class Sharing:
    """The prompts of one push's runs, stored once: what `blobs` keeps for each payload stored
    whole (`value`), then the counts of the prompts its runs refer to (`close`), in the push's
    transaction. A prompt is read and compared with the stored copy once a push, its count
    written once a push."""

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
        self.txn, self.dbs = txn, dbs
        self._seen: dict[bytes, list[Any]] = {}  # by name: the prompt, its stored count, the runs added

    def value(self, key: bytes, blob: bytes, response: int) -> bytes:
        """A reference to the payload's prompt (of `response` response tokens after it), stored
        once, or the payload itself, for one whose prompt is shorter than MIN_BYTES or has the
        digest of other bytes."""
        span = _prompt_span(blob, response)
        if span is None:
            return blob
        start, end = span
        prompt = blob[start:end]  # bytes: compared with memcmp (a memoryview compares item by item)
        digest = digests.of(prompt)
        name = key[:4] + digest
        seen = self._seen.get(name)
        if seen is None:
            found = self.txn.get(name, db=self.dbs["shared"])
            if found is None:
                self.txn.put(name, prompt, db=self.dbs["shared"])
                count = 0
            elif found != prompt:
                return blob
            else:
                count = _count(self.txn.get(name, db=self.dbs["shared_refs"]))
            seen = self._seen[name] = [prompt, count, 0]
        elif seen[0] != prompt:
            return blob
        seen[2] += 1
        view = memoryview(blob)
        return b"".join([_REF.pack(REF_MAGIC, digest, start, end - start), view[:start], view[end:]])

    def close(self) -> None:
        """Count the push's references to each prompt."""
        for name, (_, count, added) in self._seen.items():
            self.txn.put(name, _COUNT.pack(count + added), db=self.dbs["shared_refs"])
        self._seen = {}


def _prompt_span(blob: bytes, response: int) -> tuple[int, int] | None:
    """Where a payload's prompt tokens lie in it, if they take at least MIN_BYTES."""
    if len(blob) < MIN_BYTES:
        return None
    try:
        _, header, section, section_len = parts_of(blob)
        entries = stored_entries(header, section_len)
    except (ValueError, struct.error):
        return None
    assert isinstance(section, memoryview)
    for name, _, dims, start, end in entries:
        if name != _TOKENS or not dims:
            continue
        rows = int(dims.split(b",")[0])
        prompt = rows - response
        if rows <= 0 or not 0 < prompt <= rows or (end - start) % rows:
            return None
        length = (end - start) // rows * prompt
        at = len(blob) - section_len + start
        return (at, at + length) if length >= MIN_BYTES else None
    return None


def frame(value: Bytes) -> bytes:
    """A reference's frame, a copy of its first bytes: what `release` reads of it."""
    return bytes(value[: _REF.size])


def _unframe(value: Bytes) -> tuple[bytes, int, int, memoryview]:
    """A reference's prompt digest, where the prompt lies, its length and the payload without it."""
    _, digest, start, length = _REF.unpack_from(value)
    return digest, start, length, memoryview(value)[_REF.size :]


def resolve(value: Bytes, key: bytes | memoryview, read: Read) -> Bytes | SplitPayload:
    """A reference as the payload it stands for, its prompt read with `read`; one whose frame is
    damaged as its own bytes (a prompt that is missing as none), which the read check finds do
    not match."""
    try:
        digest, start, _, rest = _unframe(value)
        at = section_at(rest)
    except struct.error:
        return value
    if not at <= start <= len(rest):
        return value
    prompt = read("shared", bytes(key[:4]) + digest)
    return SplitPayload(rest[:at], [rest[at:start], b"" if prompt is None else prompt, rest[start:]])


def header_of(value: Bytes) -> tuple[bytes, int]:
    """A reference's safetensors header and the length of the section it describes, read
    without its prompt."""
    _, _, length, rest = _unframe(value)
    _, header, _, section_len = parts_of(rest)
    return header, section_len + length


def any_in(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bool:
    """Whether the table of `prefix` keeps any shared prompt (one seek)."""
    with txn.cursor(db=dbs["shared_refs"]) as cur:
        return bool(cur.set_range(prefix)) and bytes(cur.key()[: len(prefix)]) == prefix


def release(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, value: Bytes) -> None:
    """A stored reference goes: its prompt is counted once less, and goes with its last one."""
    try:
        digest = _unframe(value)[0]
    except struct.error:
        return
    name = bytes(key[:4]) + digest
    count = _count(txn.get(name, db=dbs["shared_refs"]))
    if count > 1:
        txn.put(name, _COUNT.pack(count - 1), db=dbs["shared_refs"])
    else:
        txn.delete(name, db=dbs["shared_refs"])
        txn.delete(name, db=dbs["shared"])


def _count(raw: Bytes | None) -> int:
    """A stored count; 0 for none, or for one damaged (verify then finds the prompt miscounted)."""
    try:
        return 0 if raw is None else int(_COUNT.unpack(raw)[0])
    except struct.error:
        return 0


# What mends a prompt counted otherwise than its runs refer to it (`recount`).
REPAIRS = "expbuf repair counts them again"


def _tally(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes
) -> tuple[dict[bytes, int], dict[bytes, int], set[bytes]]:
    """A table's references to each shared prompt (by digest), as its payloads hold them; each
    prompt's stored count; the prompts stored."""
    referred: dict[bytes, int] = {}
    with txn.cursor(db=dbs["blobs"]) as cur:
        present = cur.set_range(prefix)
        while present and cur.key().startswith(prefix):
            value = cur.value()
            if len(value) >= _REF.size and is_ref(value):
                digest = bytes(_unframe(value)[0])
                referred[digest] = referred.get(digest, 0) + 1
            present = cur.next()
    counted: dict[bytes, int] = {}
    kept: set[bytes] = set()
    for db, into in (("shared_refs", counted), ("shared", kept)):
        with txn.cursor(db=dbs[db]) as cur:
            present = cur.set_range(prefix)
            while present and cur.key().startswith(prefix):
                digest = bytes(cur.key()[len(prefix) :])
                if isinstance(into, dict):
                    into[digest] = _count(cur.value())
                else:
                    into.add(digest)
                present = cur.next()
    return referred, counted, kept


def check(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> list[str]:
    """A table's shared prompts against the references its payloads hold: each counted as many
    times as it is referred to, none without a count, none kept that nothing refers to."""
    referred, counted, kept = _tally(txn, dbs, prefix)
    problems = []
    wrong = sum(counted.get(digest) != count for digest, count in referred.items() if digest in kept)
    if wrong:
        problems.append(f"{wrong} shared prompt(s) are counted otherwise than their runs refer to them: {REPAIRS}")
    unreferred = (set(counted) | kept) - set(referred)
    if unreferred:
        problems.append(f"{len(unreferred)} shared prompt(s) are kept that no stored run refers to: {REPAIRS}")
    if set(referred) - kept:
        problems.append(f"{len(set(referred) - kept)} shared prompt(s) that runs refer to are missing")
    return problems


def recount(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> int:
    """Count each of a table's shared prompts as its stored runs refer to it, and drop those none
    refers to (`expbuf repair`): a run whose reference's frame was damaged released another
    prompt's count, or none, when it was quarantined, and its own prompt was then kept for good.
    How many prompts it counted again or dropped."""
    referred, counted, kept = _tally(txn, dbs, prefix)
    mended = 0
    for digest, count in referred.items():
        if digest in kept and counted.get(digest) != count:
            txn.put(prefix + digest, _COUNT.pack(count), db=dbs["shared_refs"])
            mended += 1
    for digest in (set(counted) | kept) - set(referred):
        txn.delete(prefix + digest, db=dbs["shared_refs"])
        txn.delete(prefix + digest, db=dbs["shared"])
        mended += 1
    return mended
