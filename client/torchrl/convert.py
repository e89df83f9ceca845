"""TorchRL's LLM TensorDicts and expbuf experiences, both ways, under TorchRL's own keys.

One element of a TorchRL LLM batch (one dialog turn, as `LLMCollector` writes it) is one
experience:

    TorchRL key                         expbuf Experience
    ("tokens", "prompt" | "response")   tokens split at prompt_length ("full": both, as written);
                                        sampled back as torch.long, whatever dtype they were pushed in
    ("log_probs", "response")           logprobs, in their dtype ("full": NaN over the prompt, as vLLMWrapper fills it)
    ("masks", "all_assistant_mask")     action_mask over the response (False over the prompt)
    ("masks", "all_attention_mask")     rebuilt: all True (a stored sequence holds no padding)
    ("next", "reward")                  reward: one value, shape (1, 1) float32 as TorchRL's reward parsers give
                                        it, or the dtype and shape it was pushed in (info["reward_form"])
    ("text", "prompt" | "response")     prompt_text, response_text ("full": both)
    "policy_version" (an int)           info["model_version"]
    the group key ("query")             info["group"]; the eid's task is a digest of it
    "advantage" (sampled only)          the table's advantage: one value per experience, shape (1, 1),
                                        where TorchRL's MCAdvantage writes it and GRPOLoss reads it
    ("expbuf", "uid" | "group_id")      (sampled only) the experience's uid and its group's id

The rest of an element (a ChatHistory, a reference model's log-probs, done flags) is not stored.
Tokens must be unpadded (`pad_output=False`, the wrappers' default): padded ones are refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.modules.llm.policies import LogProbs, Masks, Text, Tokens

from expbuf.client import layout
from expbuf.client.schema.experience import EID, Experience

ADVANTAGE: NestedKey = "advantage"
REWARD: NestedKey = ("next", "reward")
VERSION: NestedKey = "policy_version"
IDENTITY: NestedKey = "expbuf"  # a sampled element's uid and group id
GROUP_INFO = "group"  # info[...] that keeps an experience's group name
GROUP_FORM = "group_form"  # and, for a tensor name, its dtype and shape: [dtype, shape]
REWARD_FORM = "reward_form"  # a reward's dtype and shape, where not TorchRL's float32 (1, 1): [dtype, shape]
# Token ids as TorchRL's LLM wrappers and losses take them (embedding lookups, gathers); a stored
# experience keeps the dtype it was pushed in (AReaL's rows may hold int32).
TOKEN_DTYPE = torch.long


def elements(data: Any) -> list[TensorDictBase]:
    """The elements of what `extend` or `add` was given: a TensorDict of any batch size, or a list of them."""
    if isinstance(data, (list, tuple)):
        return [one for item in data for one in elements(item)]
    if not isinstance(data, TensorDictBase):
        raise TypeError(f"an expbuf storage stores TensorDicts (TorchRL's LLM data), not {type(data).__name__}")
    if data.ndim == 0:
        return [data]
    return list(data.reshape(-1).unbind(0) if data.ndim > 1 else data.unbind(0))


def group_name(element: TensorDictBase, group_key: NestedKey) -> tuple[str, str | list[Any]]:
    """(the eid task of the element's group, its group name as info keeps it). The name is what
    MCAdvantage groups by: a string (the prompt) or a tensor (an id), compared by value."""
    value = _get(element, group_key)
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
        kept: str | list[Any] = value[0] if len(value) == 1 else value
    elif isinstance(value, str):
        kept = value
    else:
        raise ValueError(
            f"element has no group name at {group_key!r} (a string such as the prompt, or a tensor id), "
            f"got {type(value).__name__}: pass the key that names its group as group_key"
        )
    digest = hashlib.blake2b(repr(kept).encode(), digest_size=10).hexdigest()
    return digest, kept


def _get(element: TensorDictBase, key: NestedKey) -> Any:
    """The value at `key` (a string for non-tensor data), None where there is none."""
    try:
        return element[key]
    except KeyError:
        return None


def _tokens(element: TensorDictBase) -> tuple[torch.Tensor, int]:
    if _get(element, ("tokens", "padded")) is True:
        raise ValueError("('tokens', 'padded') is True: store unpadded tokens (the LLM wrappers' pad_output=False)")
    prompt, response, full = (_get(element, ("tokens", part)) for part in ("prompt", "response", "full"))
    if prompt is not None and response is not None:
        return layout.join(prompt.reshape(-1), response.reshape(-1))
    if full is not None and (prompt is not None or response is not None):
        full = full.reshape(-1)
        cut = prompt.numel() if prompt is not None else full.numel() - response.numel()
        return full, cut
    raise ValueError(
        "element needs ('tokens', 'prompt') and ('tokens', 'response'), or one of them and ('tokens', 'full')"
    )


def _reward(element: TensorDictBase) -> float | None:
    reward = _get(element, REWARD)
    if reward is None:
        return None
    if not isinstance(reward, torch.Tensor) or reward.numel() != 1:
        shape = tuple(reward.shape) if isinstance(reward, torch.Tensor) else type(reward).__name__
        raise ValueError(f"('next', 'reward') must hold one value per element, got {shape}")
    return float(reward.reshape(()))


def _version(element: TensorDictBase) -> int | None:
    version = _get(element, VERSION)
    if isinstance(version, torch.Tensor) and version.numel() == 1 and not version.is_floating_point():
        return int(version.reshape(()))
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def to_experience(
    element: TensorDictBase, eid: EID, group: str | list[Any], group_key: NestedKey | None = None
) -> Experience:
    """One element as an experience with `eid`, its group name in info (with a tensor name's dtype
    and shape, read at `group_key`, so that it comes back as it went: an int32 id of shape (1,)
    came back an int64 of shape ())."""
    tokens, prompt_length = _tokens(element)
    response_length = tokens.numel() - prompt_length
    logprobs = _get(element, ("log_probs", "response"))
    if logprobs is None and (full := _get(element, ("log_probs", "full"))) is not None:
        logprobs = full.reshape(-1)[prompt_length:]
    assistant = _get(element, ("masks", "all_assistant_mask"))
    info: dict[str, Any] = {GROUP_INFO: group}
    named = None if group_key is None else _get(element, group_key)
    if isinstance(named, torch.Tensor):
        info[GROUP_FORM] = _form(named)
    reward = _get(element, REWARD)
    if isinstance(reward, torch.Tensor) and _form(reward) != _REWARD_DEFAULT:
        info[REWARD_FORM] = _form(reward)
    version = _version(element)
    if version is not None:
        info["model_version"] = version
    prompt_text, response_text = _get(element, ("text", "prompt")), _get(element, ("text", "response"))
    return Experience(
        tokens=tokens,
        eid=eid,
        prompt_length=prompt_length,
        reward=_reward(element),
        logprobs=layout.response_tensor(
            "('log_probs', 'response')",
            None if logprobs is None else logprobs.reshape(-1),
            response_length,
        ),
        action_mask=None if assistant is None else assistant.reshape(-1)[prompt_length:].to(torch.bool),
        info=info,
        prompt_text=prompt_text if isinstance(prompt_text, str) else None,
        response_text=response_text if isinstance(response_text, str) else None,
    )


def _advantage(exp: Experience, value: float | None = None) -> torch.Tensor | None:
    """The experience's one advantage value (`value`, where the server sent it beside the payload:
    an experience with no generated token has it there alone), else the same on every action token
    for the estimators whose values are per experience. A token-valued estimator's values are
    refused by name."""
    if value is not None:
        return torch.tensor([[value]], dtype=torch.float32)
    if exp.advantages is None:
        return None
    mask = exp.action_mask.to(torch.bool) if exp.action_mask is not None else None
    values = exp.advantages if mask is None else exp.advantages[mask]
    if values.numel() == 0:
        return torch.zeros(1, 1)
    if not bool((values == values[0]).all()):
        raise ValueError(
            f"experience {exp.eid.uid} has advantages that vary over its tokens (a token-valued estimator): "
            "TorchRL's 'advantage' holds one value per experience; use an estimator with one value per experience"
        )
    return values[:1].reshape(1, 1).to(torch.float32)


def _form(tensor: torch.Tensor) -> list[Any]:
    """A tensor's dtype and shape, as info keeps them."""
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]


_REWARD_DEFAULT = ["float32", [1, 1]]  # a reward's form as TorchRL's reward parsers give it


def _formed(value: Any, form: Any, default: list[Any] | None = None) -> torch.Tensor:
    """A value kept from a tensor, in its dtype and shape where they were kept (`form`), else
    `default`'s (none: as torch makes it of the values, as for an experience stored before)."""
    form = form if isinstance(form, list) and len(form) == 2 else default
    dtype = None if form is None else getattr(torch, form[0], None)
    if not isinstance(dtype, torch.dtype):
        return torch.tensor(value)
    return torch.tensor(value, dtype=dtype).reshape(form[1])


def to_element(exp: Experience, group_key: NestedKey, advantage: float | None = None) -> TensorDict:
    """One sampled experience as a TorchRL LLM element (a TensorDict of batch size ()); `advantage`
    its one value where the server sent it beside the payload."""
    tokens = exp.tokens.to(TOKEN_DTYPE)  # the tensor itself (no copy) where it is torch.long already
    prompt, response = layout.split(tokens, exp.prompt_length)
    element = TensorDict(batch_size=[])
    element["tokens"] = Tokens(prompt=prompt, response=response, full=tokens, padded=False, batch_size=[])
    assistant = None
    if exp.action_mask is not None:
        assistant = torch.cat([torch.zeros(exp.prompt_length, dtype=torch.bool), exp.action_mask.to(torch.bool)])
    element["masks"] = Masks(
        all_attention_mask=torch.ones(exp.tokens.numel(), dtype=torch.bool),
        all_assistant_mask=assistant,
        padded=False,
        batch_size=[],
    )
    if exp.logprobs is not None:
        prompt = torch.full((exp.prompt_length,), float("nan"), dtype=exp.logprobs.dtype)
        full = torch.cat([prompt, exp.logprobs])
        element["log_probs"] = LogProbs(response=exp.logprobs, full=full, padded=False, batch_size=[])
    if exp.prompt_text is not None or exp.response_text is not None:
        both = (exp.prompt_text or "") + (exp.response_text or "")
        element["text"] = Text(prompt=exp.prompt_text, response=exp.response_text, full=both, batch_size=[])
    group, form = exp.info.get(GROUP_INFO), exp.info.get(GROUP_FORM)
    if group is not None:
        element[group_key] = group if isinstance(group, str) else _formed(group, form)
    if exp.model_version is not None:
        element[VERSION] = exp.model_version
    if exp.reward is not None:
        element[REWARD] = _formed(exp.reward, exp.info.get(REWARD_FORM), _REWARD_DEFAULT)
    value = _advantage(exp, advantage)
    if value is not None:
        element[ADVANTAGE] = value
    element[IDENTITY] = TensorDict(uid=exp.eid.uid, group_id=exp.eid.tid, batch_size=[])
    return element


def to_elements(
    experiences: list[Experience], group_key: NestedKey, advantages: Sequence[float] = ()
) -> list[TensorDict]:
    """Sampled experiences as elements, with their advantages where the server sent them beside the
    payload (Batch.advantage_values: one per experience, else none); `lazy_stack` them for a batch
    (ragged sequences)."""
    values: Sequence[float | None] = advantages if len(advantages) == len(experiences) else [None] * len(experiences)
    return [to_element(exp, group_key, value) for exp, value in zip(experiences, values, strict=True)]
