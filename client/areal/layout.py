"""Response-length TRXP fields <-> full-length, right-padded rows, for the frameworks that train
on whole sequences: where a row's prompt ends, how response values sit in a full row, the
next-token shift, and run-length codes for per-token values (padding is `expbuf.client.layout`'s,
which the verl adapter shares).

Torch only; no framework imports, so each framework's adapter is a thin layer over this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def seq_length(attention_mask: torch.Tensor, where: str) -> int:
    """The length of a right-padded row: its ones, which must all come before its zeros."""
    mask = attention_mask.bool()
    length = int(mask.sum())
    if not bool(mask[:length].all()):
        raise ValueError(f"{where}: attention_mask is not right-padded (a 0 comes before a 1)")
    return length


def prompt_length(loss_mask: torch.Tensor, where: str) -> int:
    """Where the loss mask first turns 1: the prompt is what comes before it."""
    ones = torch.nonzero(loss_mask, as_tuple=False)
    if ones.numel() == 0:
        raise ValueError(f"{where}: loss_mask has no 1, so the row has no generated token")
    return int(ones[0, 0])


def to_response(row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The response part [start, end) of a full row, as a tensor of its own."""
    return row[start:end].clone()


def to_full(values: torch.Tensor | None, start: int, length: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
    """A full row of `length`: `fill` before `start`, then `values` (or `fill` where there are none)."""
    row = torch.full((length,), fill, dtype=dtype)
    if values is not None:
        row[start : start + values.numel()] = values.to(dtype)
    return row


def shift_left(full: torch.Tensor) -> torch.Tensor:
    """The next-token shift: position t takes the value of position t + 1 (the last gets 0),
    so a value for generated token t + 1 sits at the position whose logits predict it."""
    out = torch.zeros_like(full)
    out[..., :-1] = full[..., 1:]
    return out


def rle_encode(values: Iterable[int]) -> list[list[int]]:
    """[[value, count], ...] of consecutive equal values: a few runs for a row of versions."""
    runs: list[list[int]] = []
    for v in values:
        v = int(v)
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def rle_decode(runs: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for value, count in runs:
        out.extend([int(value)] * int(count))
    return out
