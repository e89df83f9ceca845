"""Partial rollouts: a rollout pushed in pieces as it is generated, so that what a worker generated
survives the worker (a crash, a preemption, a weight update that aborts it).

A piece is an experience whose `info` carries the marks: `partial_offset`, how many of the
rollout's tokens the buffer holds before this piece (0, or absent, for the first), and `partial`,
True while more pieces follow. The first piece has the prompt and the response so far; each later
one has only the tokens that follow (`prompt_length` 0), with their log-probs, mask and other
response fields, and its own version segments, counted from its own first token. The piece without
`partial` finishes the rollout: the buffer puts the pieces together (`merge`) into the experience
the worker would have pushed whole, and only that experience joins its group.

Tensors laid along the tokens (`tokens`, `routed_experts`) and along the response (log-probs, the
action mask, ...: RESPONSE_TENSOR_FIELDS) are appended piece by piece; every later piece carries each
of those the first piece has, of the same dtype and inner shape, and nothing else. Any other tensor
(an image's pixels) comes with the first piece. The finished experience's metadata is the last
piece's (its reward, info, messages), less the marks, with the first piece's prompt length and the
pieces' version segments joined.

Pure bytes, without torch: the storage engine checks and merges pieces with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...schema.experience import RESPONSE_TENSOR_FIELDS
from .common import INT64_MAX, RawItem, RawTensor, TrxpError
from .segments import KEY as SEGMENTS

PARTIAL = "partial"  # info: True on a piece that more pieces follow
OFFSET = "partial_offset"  # info: the rollout's tokens the buffer holds before this piece
MARKS = (PARTIAL, OFFSET)
FIRST_ONLY = ("prompt_length", "multi_modal_input_keys")  # metadata of the first piece's own tensors and prompt
TOKEN_LAID = ("tokens", "routed_experts")  # appended along the tokens; RESPONSE_TENSOR_FIELDS along the response

# What each later piece must carry: the appended tensors of a rollout's first piece, by name, with
# their dtype and inner shape (all but the first dimension).
Layout = dict[str, tuple[str, tuple[int, ...]]]


class Mark(NamedTuple):
    """A piece's place in its rollout: the tokens held before it, and whether more pieces follow."""

    offset: int
    more: bool


def mark_of(meta: Mapping[str, Any]) -> Mark | None:
    """The piece marks of a checked experience's metadata; None for an experience pushed whole."""
    return marks_in(meta.get("info") or {})


def marks_in(info: Mapping[str, Any]) -> Mark | None:
    """`mark_of` from the experience's info, where the caller has it already."""
    more, offset = info.get(PARTIAL) is True, info.get(OFFSET) or 0
    return Mark(offset, more) if more or offset else None


def check(where: str, meta: Mapping[str, Any]) -> None:
    """The marks of an experience's metadata, checked; TrxpError naming what is wrong otherwise."""
    info = meta.get("info") or {}
    more, offset = info.get(PARTIAL), info.get(OFFSET)
    if more is not None and type(more) is not bool:
        raise TrxpError(f"{where}: info.{PARTIAL} must be True or False, got {type(more).__name__}")
    if offset is None:
        return
    if type(offset) is not int or not 0 <= offset <= INT64_MAX:
        raise TrxpError(f"{where}: info.{OFFSET} must be an int from 0 to 2**63 - 1, got {offset!r:.40}")
    if offset and meta.get("prompt_length", 1) != 0:
        raise TrxpError(
            f"{where}: a piece that continues a rollout (info.{OFFSET} {offset}) has only tokens after the prompt: "
            f"its prompt_length must be 0, got {meta.get('prompt_length', 1)!r:.40}"
        )


def layout(first: RawItem) -> Layout:
    """The tensors the later pieces of a rollout whose first piece is `first` append to."""
    return {
        name: (tensor.dtype, tensor.shape[1:])
        for name, tensor in first.tensors.items()
        if (name in TOKEN_LAID or name in RESPONSE_TENSOR_FIELDS) and tensor.shape
    }


def follows(where: str, held: Layout, piece: RawItem) -> None:
    """Check that a later piece carries what its rollout appends to, and nothing else."""
    names = set(piece.tensors)
    if names != set(held):
        extra, lacking = sorted(names - set(held)), sorted(set(held) - names)
        said = [f"carries {', '.join(extra)}, which the first piece has not" if extra else "",
                f"lacks {', '.join(lacking)}, which the first piece has" if lacking else ""]  # fmt: skip
        raise TrxpError(f"{where}: the piece {' and '.join(s for s in said if s)}; a later piece appends to each")
    for name, (dtype, inner) in held.items():
        tensor = piece.tensors[name]
        if tensor.dtype != dtype or tensor.shape[1:] != inner:
            raise TrxpError(
                f"{where}: field '{name}' is {tensor.dtype} of inner shape {list(tensor.shape[1:])}; "
                f"the rollout's is {dtype} of {list(inner)}"
            )


def response_of(item: RawItem) -> int:
    """The response tokens a piece adds (a later piece's are all its tokens)."""
    prompt: int = item.meta.get("prompt_length", 1)
    return item.tensors["tokens"].shape[0] - prompt


def merge(pieces: Sequence[RawItem]) -> RawItem:
    """A rollout's pieces (checked, in order) put together: the experience pushed whole. Its
    metadata is the last piece's but for what describes the first piece's own tensors and prompt
    (`prompt_length`, `multi_modal_input_keys`)."""
    first, last = pieces[0], pieces[-1]
    tensors = dict(first.tensors)
    for name in layout(first):
        parts = [piece.tensors[name] for piece in pieces]
        rows = sum(part.shape[0] for part in parts)
        data = b"".join([bytes(part.data) for part in parts])
        tensors[name] = RawTensor(first.tensors[name].dtype, (rows, *first.tensors[name].shape[1:]), data)
    meta = dict(last.meta)
    for key in FIRST_ONLY:
        if key in first.meta:
            meta[key] = first.meta[key]
        else:
            meta.pop(key, None)
    info = {key: value for key, value in (last.meta.get("info") or {}).items() if key not in MARKS}
    segments = joined_segments(pieces)
    if segments is not None:
        info[SEGMENTS] = segments
    if info or "info" in meta:
        meta["info"] = info
    return RawItem(meta, tensors)


def joined_segments(pieces: Sequence[RawItem]) -> list[list[int]] | None:
    """The version segments of the rollout the pieces make: each piece's, moved by the response
    tokens before it, a segment of the version before it left out; None when no piece has any."""
    joined: list[list[int]] = []
    base = 0
    for piece in pieces:
        for version, offset in (piece.meta.get("info") or {}).get(SEGMENTS) or ():
            if not joined or joined[-1][0] != version:
                joined.append([version, base + offset])
        base += response_of(piece)
    return joined or None


@dataclass(frozen=True, slots=True)
class Versions:
    """What a rollout's pieces so far say of its version segments: whether they carry them (None
    until a piece with response tokens, which alone can, says), and the last version."""

    carried: bool | None = None
    last: int | None = None

    def after(self, where: str, piece: RawItem) -> Versions:
        """The state once `piece` is added; TrxpError where its segments do not follow: every piece
        with response tokens has them or none has, and versions never decrease across pieces."""
        segments: list[list[int]] = (piece.meta.get("info") or {}).get(SEGMENTS) or []
        if not response_of(piece):
            return self
        has = bool(segments)
        if self.carried is not None and has != self.carried:
            raise TrxpError(
                f"{where}: info.{SEGMENTS} must be given with every piece of a rollout that has response tokens, "
                f"or with none; the pieces before {'lack' if has else 'have'} them"
            )
        if not has:
            return Versions(False, None)
        first = segments[0][0]
        if self.last is not None and first < self.last:
            raise TrxpError(
                f"{where}: info.{SEGMENTS} starts at version {first}, older than the rollout's last ({self.last})"
            )
        return Versions(True, segments[-1][0])
