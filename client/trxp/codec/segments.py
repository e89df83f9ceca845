"""Per-token policy versions: an experience's version segments, and the action mask that hides
the tokens a table's `max_token_staleness` leaves behind.

A rollout interrupted by weight updates has tokens from several policies. Its rollout worker
says which in `info["version_segments"]`: `[[version, offset], ...]`, as prime-rl stamps a
request, each the policy version that generated the response's tokens from `offset` (0 = the
first token after the prompt) up to the next segment's offset. Offsets start at 0 and increase,
each inside the response; versions never decrease. An experience's own version (the one
per-experience staleness and `min_model_version` read) is then its oldest token's.

Since versions never decrease, the tokens older than any bound are a prefix of the response:
`stale_tokens` counts it, and `masked` hides it in the action mask, from the bytes, without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .common import INT64_MAX, ITEMSIZE, SEGMENTS_KEY, RawTensor, TrxpError

KEY = SEGMENTS_KEY  # where an experience's info carries them

# Segments flattened as the store keeps them: version, offset, version, offset, ...
Flat = tuple[int, ...]


def check(where: str, segments: Any, response_length: int) -> Flat:
    """An experience's `info["version_segments"]` checked against its response, flattened;
    TrxpError naming what is wrong otherwise."""
    if not isinstance(segments, (list, tuple)) or not segments:
        raise TrxpError(
            f"{where}: info.{KEY} must be a non-empty list of [version, offset] pairs, got {_show(segments)}"
        )
    if response_length == 0:
        raise TrxpError(f"{where}: info.{KEY} is given, but the experience has no response tokens")
    flat: list[int] = []
    for at, pair in enumerate(segments):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TrxpError(f"{where}: info.{KEY}[{at}] must be a [version, offset] pair, got {_show(pair)}")
        version, offset = pair
        if type(version) is not int or not 0 <= version <= INT64_MAX:
            raise TrxpError(
                f"{where}: info.{KEY}[{at}]: version must be an int from 0 to 2**63 - 1, got {_show(version)}"
            )
        if type(offset) is not int or not 0 <= offset < response_length:
            raise TrxpError(
                f"{where}: info.{KEY}[{at}]: offset must be an int inside the response (0 to {response_length - 1}), "
                f"got {_show(offset)}"
            )
        if at == 0 and offset != 0:
            raise TrxpError(f"{where}: info.{KEY} must start at offset 0 (the response's first token), got {offset}")
        if at and offset <= flat[-1]:
            raise TrxpError(f"{where}: info.{KEY}[{at}]: offsets must increase, got {offset} after {flat[-1]}")
        if at and version < flat[-2]:
            raise TrxpError(f"{where}: info.{KEY}[{at}]: versions must not decrease, got {version} after {flat[-2]}")
        flat += (version, offset)
    return tuple(flat)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def stale_tokens(segments: Flat, response_length: int, bound: int) -> int:
    """How many of the response's tokens (a prefix) a policy older than `bound` generated."""
    for at in range(0, len(segments), 2):
        if segments[at] >= bound:
            return segments[at + 1]
    return response_length


def masked(mask: RawTensor | None, response_length: int, stale: int) -> RawTensor:
    """The action mask with its first `stale` tokens masked out (zero), the rest as pushed; a mask
    of ones (bool) where the experience had none."""
    if mask is None:
        return RawTensor("BOOL", (response_length,), bytes(stale) + b"\x01" * (response_length - stale))
    cut = stale * ITEMSIZE[mask.dtype]
    return RawTensor(mask.dtype, mask.shape, bytes(cut) + bytes(memoryview(mask.data)[cut:]))


def as_pairs(segments: Sequence[int]) -> list[list[int]]:
    """Flattened segments as the [version, offset] pairs a rollout worker wrote."""
    return [[segments[at], segments[at + 1]] for at in range(0, len(segments), 2)]
