"""AReaL's trajectory rows <-> TRXP experiences.

AReaL's workflows return full-length, right-padded rows: `input_ids`, `attention_mask`,
`loss_mask`, `logprobs` and `versions` of [rows, width], and `rewards` of [rows]. An
experience keeps the tokens whole and the response part of the others: the prompt ends where
`loss_mask` first turns 1, and the holes after it (tool output, a user's turn) stay as 0s of
`action_mask`. The per-token versions go to `info`: their least generated one as
`model_version` (the staleness screen's), every one run-length encoded, so a row comes back
exactly as it was, and the response's as version segments (client/trxp/codec/segments.py), which a
table's `max_token_staleness` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..layout import pad
from ..schema.experience import EID, Experience
from . import layout

# The run-length code of a row's per-token versions, prompt included ([[version, count], ...]).
TOKEN_VERSIONS = "token_versions"
# The table's advantages in an AReaL dict: a key of their own, since AReaL's actor writes its
# own `advantages` (KeepExpbufAdvantages puts these in their place).
EXPBUF_ADVANTAGES = "expbuf_advantages"
REQUIRED = ("input_ids", "attention_mask", "loss_mask")
OPTIONAL = ("logprobs", "versions", "rewards")
# AReaL's own dtypes (its RLVR and multi-turn workflows); input_ids keep the tokens' dtype.
DTYPES = {
    "attention_mask": torch.bool,
    "loss_mask": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "rewards": torch.float32,
}


def _check_rows(rows: dict[str, Any]) -> int:
    missing = [k for k in REQUIRED if k not in rows]
    if missing:
        raise ValueError(f"AReaL rows lack {missing}; they need {list(REQUIRED)}")
    unknown = sorted(set(rows) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"AReaL rows carry {unknown}, which TRXP has no field for; map {list(REQUIRED + OPTIONAL)}")
    count, width = rows["input_ids"].shape
    for key in REQUIRED + OPTIONAL:
        if key not in rows:
            continue
        shape = tuple(rows[key].shape)
        if shape != ((count,) if key == "rewards" else (count, width)):
            raise ValueError(f"AReaL rows: '{key}' has shape {list(shape)}; input_ids has {[count, width]}")
    return count


def _model_version(versions: torch.Tensor, mask: torch.Tensor) -> int | None:
    stamped = versions[mask.bool() & (versions >= 0)]
    return int(stamped.min()) if stamped.numel() else None


def _segments(versions: list[int]) -> list[list[int]] | None:
    """A response's per-token versions as version segments: a token without one (-1: a tool's
    output) has the version before it (the first stamped one at the start). None when no token has
    one, or when they decrease (segments' versions never do; AReaL's weights only move forward)."""
    stamped = [version for version in versions if version >= 0]
    if not stamped:
        return None
    segments: list[list[int]] = []
    last = stamped[0]
    for offset, version in enumerate(versions):
        version = last if version < 0 else version
        if version < last:
            return None
        if not segments or version != last:
            segments.append([version, offset])
            last = version
    return segments


def from_areal(rows: dict[str, Any], eids: Sequence[EID] | None = None) -> list[Experience]:
    """One experience per row of an AReaL trajectory dict (eids in row order, or fresh ones)."""
    count = _check_rows(rows)
    if eids is not None and len(eids) != count:
        raise ValueError(f"{len(eids)} eids for {count} rows")
    out = []
    for i in range(count):
        where = f"AReaL row {i}"
        length = layout.seq_length(rows["attention_mask"][i], where)
        start = layout.prompt_length(rows["loss_mask"][i, :length], where)
        info: dict[str, Any] = {}
        logprobs = None
        if "logprobs" in rows:
            if bool(rows["logprobs"][i, :start].any()):
                raise ValueError(f"{where}: logprobs are set within the prompt (before loss_mask turns 1)")
            logprobs = layout.to_response(rows["logprobs"][i], start, length).float()
        if "versions" in rows:
            versions = rows["versions"][i, :length]
            version = _model_version(versions[start:], rows["loss_mask"][i, start:length])
            if version is not None:
                info["model_version"] = version
            info[TOKEN_VERSIONS] = layout.rle_encode(versions.tolist())
            segments = _segments(versions[start:].tolist())
            if segments is not None:
                info["version_segments"] = segments
        out.append(
            Experience(
                tokens=rows["input_ids"][i, :length].clone(),
                eid=eids[i] if eids is not None else EID(),
                prompt_length=start,
                reward=float(rows["rewards"][i]) if "rewards" in rows else None,
                logprobs=logprobs,
                action_mask=layout.to_response(rows["loss_mask"][i], start, length).bool(),
                info=info,
            )
        )
    return out


def _versions(exp: Any, start: int, length: int) -> torch.Tensor:
    runs = exp.info.get(TOKEN_VERSIONS)
    if runs is not None:
        versions = torch.tensor(layout.rle_decode(runs), dtype=DTYPES["versions"])
        if versions.numel() != length:
            raise ValueError(
                f"experience {exp.eid}: info['{TOKEN_VERSIONS}'] covers {versions.numel()} of {length} tokens"
            )
        return versions
    versions = torch.full((length,), -1, dtype=DTYPES["versions"])
    segments = exp.info.get("version_segments")  # pushed by another worker than AReaL's
    if segments:
        ends = [offset for _, offset in segments[1:]] + [length - start]
        for (version, offset), end in zip(segments, ends, strict=True):
            versions[start + offset : start + end] = version
        return versions
    version = exp.info.get("model_version")
    if version is not None:
        versions[start:] = version
    return versions


def _reward(exp: Any) -> float:
    """An experience's reward as AReaL's `rewards` holds it: its own, or where it has none the sum
    of its token-level rewards (its score, as the estimators take it); one with neither is
    refused: a 0.0 made up for it gave AReaL's actor no signal, and said nothing."""
    if exp.reward is not None:
        return float(exp.reward)
    level = getattr(exp, "token_level_reward", None)
    if level is None:
        raise ValueError(f"experience {exp.eid}: no reward, nor token-level rewards, for AReaL's `rewards`")
    return float(level.double().sum())


def to_areal(experiences: Sequence[Any], width: int | None = None, *, advantages: bool = False) -> dict[str, Any]:
    """One right-padded AReaL trajectory dict of the experiences (expbuf's or Trinity-RFT's).

    With `advantages`, the experiences' advantages also come, as `expbuf_advantages`, placed
    with AReaL's next-token shift: the value of generated token t + 1 at position t, where
    AReaL's loss reads it (AReaL rolls `loss_mask` and `logprobs` by -1 the same way)."""
    if not experiences:
        raise ValueError("to_areal needs at least one experience")
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in ("input_ids", "loss_mask", "logprobs", "versions")}
    masks, rewards, advs = [], [], []
    for exp in experiences:
        tokens = exp.tokens.reshape(-1)
        length, start = tokens.numel(), int(exp.prompt_length)
        mask = exp.action_mask
        if mask is None:
            mask = torch.ones(length - start, dtype=torch.bool)
        fields["input_ids"].append(tokens)
        fields["loss_mask"].append(layout.to_full(mask, start, length, DTYPES["loss_mask"]))
        fields["logprobs"].append(layout.to_full(exp.logprobs, start, length, DTYPES["logprobs"]))
        fields["versions"].append(_versions(exp, start, length))
        masks.append(torch.ones(length, dtype=DTYPES["attention_mask"]))
        rewards.append(_reward(exp))
        if advantages:
            if exp.advantages is None:
                raise ValueError(f"experience {exp.eid} has no advantages (the table computed none)")
            advs.append(layout.shift_left(layout.to_full(exp.advantages, start, length, torch.float32)))
    out = {k: pad(v, "right", width=width) for k, v in fields.items()}
    out["attention_mask"] = pad(masks, "right", width=width)
    out["rewards"] = torch.tensor(rewards, dtype=DTYPES["rewards"])
    if advantages:
        out[EXPBUF_ADVANTAGES] = pad(advs, "right", width=width)
    return out
