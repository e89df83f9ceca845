"""Partial rollouts from a rollout worker's side: a rollout as the pieces it pushes while it
generates (`split`), and the piece that continues a rollout the buffer holds in pieces
(`continuation`). client/trxp/codec/partial.py says what a piece is and what the buffer makes of them.

```python
first, second, last = split(rollout, cuts=[512, 1024])  # response offsets
client.push([first], table)   # each piece durable when its push returns
...
held = client.get_partials([rollout.eid.tid], table)[0]  # after a crash: the rollout so far
client.push([continuation(held, tokens=more, logprobs=..., action_mask=..., reward=1.0)], table)
```
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .schema.experience import RESPONSE_TENSOR_FIELDS, Experience
from .trxp.codec.partial import OFFSET, PARTIAL, TOKEN_LAID
from .trxp.codec.segments import KEY as SEGMENTS


def split(exp: Experience, cuts: Sequence[int]) -> list[Experience]:
    """`exp` as the pieces a worker pushes, cut at these offsets of its response (increasing, inside
    it): the first with the prompt, each later one with the tokens after its cut and
    `prompt_length` 0, all but the last marked partial. The last carries `exp`'s metadata (its
    reward, info, messages); each its share of the version segments. Pushed in order, the buffer
    puts them together into `exp`."""
    response = exp.tokens.shape[0] - exp.prompt_length
    bounds = [0, *cuts, response]
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cuts {list(cuts)} must increase strictly inside the response (1 to {response - 1})")
    pieces = []
    prompt = exp.prompt_length
    for at, (start, end) in enumerate(itertools.pairwise(bounds)):
        last = at == len(bounds) - 2
        fields: dict[str, Any] = {}
        for name in TOKEN_LAID:  # the prompt's rows with the first piece
            tensor = getattr(exp, name, None)
            if tensor is not None:
                fields[name] = tensor[prompt + start if start else 0 : prompt + end]
        for name in RESPONSE_TENSOR_FIELDS:
            tensor = getattr(exp, name, None)
            if tensor is not None:
                fields[name] = tensor[start:end]
        info = dict(exp.info) if last else {}
        segments = _segments(exp.info.get(SEGMENTS), start, end)
        if segments is not None:
            info[SEGMENTS] = segments
        if start:
            info[OFFSET] = prompt + start
        if not last:
            info[PARTIAL] = True
        base = exp if last else Experience(tokens=exp.tokens, eid=exp.eid)
        whole = start == 0  # the tensors not laid along the tokens come with the first piece
        pieces.append(
            dataclasses.replace(
                base,
                **fields,
                prompt_length=prompt if whole else 0,
                info=info,
                chosen=exp.chosen if whole else None,
                rejected=exp.rejected if whole else None,
                multi_modal_inputs=exp.multi_modal_inputs if whole else {},
            )
        )
    return pieces


def _segments(segments: list[list[int]] | None, start: int, end: int) -> list[list[int]] | None:
    """The version segments of response tokens start to end, counted from start."""
    if not segments:
        return None
    inside = [[version, 0] for version, offset in segments if offset <= start][-1:]
    inside += [[version, offset - start] for version, offset in segments if start < offset < end]
    return inside


def continuation(
    partial: Experience,
    tokens: torch.Tensor,
    *,
    more: bool = False,
    version_segments: list[list[int]] | None = None,
    **fields: Any,
) -> Experience:
    """The piece that continues `partial` (the rollout so far, as `get_partials` returns it or as
    the worker has it): `tokens` that follow, and the response fields of the same length given in
    `fields` (`logprobs`, `action_mask`, ...; `routed_experts` of a row a token), at the tokens the
    buffer holds. The last piece (`more` False) carries the rollout's `reward`, `info` and the rest
    of its metadata in `fields`."""
    info = dict(fields.pop("info", None) or {})
    info[OFFSET] = partial.tokens.shape[0]
    if more:
        info[PARTIAL] = True
    if version_segments is not None:
        info[SEGMENTS] = version_segments
    return Experience(tokens=tokens, eid=partial.eid, prompt_length=0, info=info, **fields)
