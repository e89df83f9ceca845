"""What is checked of a stored experience before it leaves the store (a sampled batch, a Get)
and by the full check of a directory: that its payload is the one pushed (the digest taken at
push), and that its stored advantage can be served as the float32 a batch carries it in.

A payload upgraded from format 1 keeps the layout it was pushed in, with the digest of its
canonical packing: its own bytes are compared through that packing (slow, and only for such
payloads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from expbuf.client.trxp.codec.common import FLOAT32_MAX, TrxpError
from expbuf.client.trxp.codec.parse import parse
from expbuf.client.trxp.stored.pieces import SplitPayload, Stored

from ...disk import digests
from ...disk.kinds import Entry
from ...schema.views import MemberView


def payload_problem(uid: str, rec: MemberView, blob: Stored) -> str | None:
    """Why the stored payload is not the one pushed (damage on disk), or None when it is."""
    return stored_problem(uid, rec.size, rec.digest, blob)


def stored_problem(uid: str, size: int, digest: bytes, blob: Stored) -> str | None:
    """Why the stored payload is not the one of `size` bytes and `digest` taken at push, or None when
    it is: a records table's record or a rows table's member row names them."""
    problem = digests.mismatch(blob, size, digest)
    if problem is None or len(blob) != size or isinstance(blob, SplitPayload):
        return problem  # one stored in chunks (from format 6) has its digest of these very bytes
    try:
        items = parse(bytes(blob), trusted=True)
    except TrxpError:
        items = []
    if len(items) == 1 and items[0].uid == uid and Entry.of(items[0]).digest == digest:
        return None
    return "its payload does not match its digest"


@dataclass(frozen=True)
class Unservable:
    """An experience that cannot be served, and why."""

    uid: str
    why: str
    damaged: bool  # its payload is not the one pushed (else: its stored advantage is beyond float32)

    def __str__(self) -> str:
        return f"experience {self.uid}: {self.why}"


def serve_problem(uid: str, rec: MemberView, blob: Stored | None) -> Unservable | None:
    """Why the experience cannot be served (its payload is damaged, or its stored advantage
    is beyond float32), or None when it can; without `blob`, its payload is checked elsewhere."""
    return unservable(uid, rec.advantage, rec.size, rec.digest, blob)


def unservable(uid: str, advantage: float | None, size: int, digest: bytes, blob: Stored | None) -> Unservable | None:
    """`serve_problem` of an experience whose record says `advantage`, `size` and `digest`."""
    if advantage is not None and not -FLOAT32_MAX <= advantage <= FLOAT32_MAX:
        return Unservable(uid, f"its stored advantage {advantage!r} is beyond float32's range", damaged=False)
    if blob is None or digests.matches(blob, size, digest):
        return None
    problem = stored_problem(uid, size, digest, blob)
    return None if problem is None else Unservable(uid, problem, damaged=True)


def all_unservable(
    uids: Sequence[str],
    advantages: Sequence[float | None],
    sizes: Sequence[int],
    found: Sequence[bytes],
    blobs: Sequence[bytes | memoryview],
) -> list[tuple[int, Unservable]]:
    """`unservable` of each experience of a batch whose payloads were read, each stored whole
    (`blobs`): the index of each that cannot be served, and why. A batch all of which can be served
    (mostly) is found so a list at a time, no Python step an experience; else each is looked at."""
    if digests.each_matches(blobs, sizes, found) and _servable(advantages):
        return []
    problems = []
    for at, ok in enumerate(digests.all_match(blobs, sizes, found)):
        advantage = advantages[at]
        if ok and (advantage is None or -FLOAT32_MAX <= advantage <= FLOAT32_MAX):
            continue
        problem = unservable(uids[at], advantage, sizes[at], found[at], blobs[at])
        if problem is not None:
            problems.append((at, problem))
    return problems


def _servable(advantages: Sequence[float | None]) -> bool:
    """Whether every stored advantage (None: none is stored) lies within float32's range, a list at
    a time: a NaN, or infinities of both signs, make their sum NaN, and then the caller looks at each."""
    absent = advantages.count(None)
    if absent == len(advantages):
        return True
    present = [a for a in advantages if a is not None] if absent else cast("Sequence[float]", advantages)
    total = sum(present)
    return total == total and min(present) >= -FLOAT32_MAX and max(present) <= FLOAT32_MAX
