"""TRXP's sequence layout and the full-length, padded layout trainers use, with exact round trips.

A TRXP experience is one token sequence with a prompt length; its per-token tensors
(action_mask, logprobs, advantages, ...) have the response's length. Trainers see either one
row per sequence (prompt and response apart, as verl's TransferQueue stores them) or a batch
of padded arrays: prompts left-padded to a common width, responses right-padded, so that the
prompt ends and the response starts at the same column in every row. Masks keep their interior
zeros (tool output between turns) both ways; only the padding is added and taken away.
This module knows no framework: verl's and AReaL's adapters share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

Side = Literal["left", "right"]


def split(tokens: torch.Tensor, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) of a TRXP token sequence."""
    if not 0 <= prompt_length <= tokens.shape[0]:
        raise ValueError(f"prompt_length {prompt_length} is outside the sequence of {tokens.shape[0]} tokens")
    return tokens[:prompt_length], tokens[prompt_length:]


def join(prompt: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The TRXP token sequence and prompt length of a prompt and its response."""
    return torch.cat([prompt, response]), int(prompt.shape[0])


@overload
def response_tensor(name: str, values: torch.Tensor, response_length: int) -> torch.Tensor: ...
@overload
def response_tensor(name: str, values: torch.Tensor | None, response_length: int) -> torch.Tensor | None: ...
def response_tensor(name: str, values: torch.Tensor | None, response_length: int) -> torch.Tensor | None:
    """A per-response-token tensor, checked to have the response's length (None stays None)."""
    if values is not None and values.shape[0] != response_length:
        raise ValueError(f"{name} has {values.shape[0]} values for a response of {response_length} tokens")
    return values


def reward_at_last_token(reward: float, response_length: int) -> torch.Tensor:
    """A token-level reward with `reward` on the last response token (the outcome-reward convention)."""
    scores = torch.zeros(response_length, dtype=torch.float32)
    if response_length:
        scores[-1] = reward
    return scores


def outcome_reward(scores: torch.Tensor) -> float | None:
    """The reward of a token-level score that holds it on the last token only; None otherwise."""
    if scores.numel() == 0 or bool(scores[:-1].any()):
        return None
    return float(scores[-1])


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only attended tokens (0 under left padding), as verl and HF models expect."""
    return (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0)


def pad(rows: Sequence[torch.Tensor], side: Side, value: float | int = 0, width: int | None = None) -> torch.Tensor:
    """Stack rows of different lengths into one [batch, width, ...] tensor, padded on `side`."""
    width = max((row.shape[0] for row in rows), default=0) if width is None else width
    if not rows:
        return torch.empty(0, width)
    first = rows[0]
    out = torch.full((len(rows), width, *first.shape[1:]), value, dtype=first.dtype)
    for i, row in enumerate(rows):
        n = row.shape[0]
        if n > width:
            raise ValueError(f"row {i} has {n} entries, more than the width {width}")
        if side == "left":
            out[i, width - n :] = row
        else:
            out[i, :n] = row
    return out


def unpad(batch: torch.Tensor, lengths: Sequence[int], side: Side) -> list[torch.Tensor]:
    """The rows of a padded batch, given each row's length."""
    width = batch.shape[1]
    return [batch[i, width - n :] if side == "left" else batch[i, :n] for i, n in enumerate(lengths)]


def padded_batch(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    response_tensors: dict[str, Sequence[torch.Tensor]] | None = None,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Full-length padded arrays of a batch: `prompts` [B, P] left-padded, `responses` [B, R]
    right-padded, `input_ids` [B, P+R], `attention_mask`, `position_ids`, and each named
    per-response tensor [B, R] right-padded with zeros."""
    out = {"prompts": pad(prompts, "left", pad_token_id), "responses": pad(responses, "right", pad_token_id)}
    ones = [torch.ones(p.shape[0], dtype=torch.int64) for p in prompts]
    answered = [torch.ones(r.shape[0], dtype=torch.int64) for r in responses]
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    out["attention_mask"] = torch.cat([pad(ones, "left"), pad(answered, "right")], dim=1)
    out["position_ids"] = position_ids(out["attention_mask"])
    for name, rows in (response_tensors or {}).items():
        out[name] = pad(rows, "right", 0, width=out["responses"].shape[1])
    return out


def unpadded_rows(batch: dict[str, torch.Tensor]) -> tuple[list[int], list[int], dict[str, list[torch.Tensor]]]:
    """Inverse of padded_batch: (prompt lengths, response lengths, every [B, ...] field's rows
    without padding); the lengths come from the attention mask."""
    width = batch["prompts"].shape[1]
    mask = batch["attention_mask"]
    prompt_lengths = mask[:, :width].sum(dim=1).tolist()
    response_lengths = mask[:, width:].sum(dim=1).tolist()
    rows = {
        "prompts": unpad(batch["prompts"], prompt_lengths, "left"),
        "responses": unpad(batch["responses"], response_lengths, "right"),
    }
    for name, value in batch.items():
        if name not in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
            rows[name] = unpad(value, response_lengths, "right")
    return prompt_lengths, response_lengths, rows
