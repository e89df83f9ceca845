"""expbuf experiences ↔ verl V1 trajectory rows, under the field names verl's agent loop writes
into TransferQueue (`verl/trainer/ppo/v1/agent_loop_tq.py`).

A row is one TransferQueue entry: its key `{uid}_{session_id}_{index}`, its tag and its
fields, unpadded (verl pads them when it reads a batch; expbuf.client.layout pads for those
who want arrays).

    verl field                      expbuf Experience
    prompts, responses, input_ids   tokens split at prompt_length
    response_mask (= loss_mask)     action_mask; interior zeros (tool turns) kept both ways
    rollout_log_probs               logprobs
    rm_scores                       reward on the last response token; token_level_reward otherwise
    advantages, returns             advantages, returns
    routed_experts                  routed_experts
    extra_fields.min/max_global_steps   info["model_version"] / info["max_model_version"]
    extra_fields.reward_extra_info  info["reward_extra_info"]; the other extra_fields in info["extra_fields"]
    uid, session_id, key index      eid: batch "verl", task uid, run session_id, step index
    dataset columns, num_turns      info under their own names
    metrics                         metrics
    attention_mask, position_ids    rebuilt (all ones; 0..n-1)
    multi_modal_inputs              {} (text only)

Not mapped, and why: a KL penalty in the reward and GAE need the trainer's reference and
critic forwards, so they stay verl's; VLM mrope positions need the model's processor, so
rows with multi-modal inputs are refused; chosen/rejected (DPO pairs) have no V1 field.

An experience that did not come from verl (a Trinity explorer's, say) keeps its own eid
and the fields verl has no name for in the row's `expbuf` field, so that it comes back
exactly; its verl uid is its task id with '%' and '_' escaped (verl splits keys at '_').
Rows of a sampled batch take its group ids: a table that groups finer than by task (by run,
step or experience) holds several groups of one task, and each is a uid of its own, as verl's
GRPO groups by uid and keys are unique by uid.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from expbuf.client import layout
from expbuf.client.schema.experience import EID, Experience

VERL_BATCH = "verl"  # eid.batch of an experience that verl's agent loop produced
SUFFIX = "0"
ROW_TENSORS = (
    "prompts",
    "responses",
    "input_ids",
    "position_ids",
    "response_mask",
    "loss_mask",
    "rollout_log_probs",
    "rm_scores",
    "advantages",
    "returns",
    "routed_experts",
)
_NOT_INFO = {*ROW_TENSORS, "uid", "session_id", "extra_fields", "metrics", "multi_modal_inputs", "expbuf"}
_FOREIGN_META = ("truncate_status", "response_text", "prompt_text", "messages", "tools", "custom_fields")


@dataclass
class Row:
    """One TransferQueue entry of verl's V1 trainer."""

    key: str
    tag: dict[str, Any]
    fields: dict[str, Any] = field(default_factory=dict)


def verl_uid(eid: EID, group_id: str | None = None) -> str:
    """The verl prompt uid of an experience's group (no '_': verl splits keys there): its task's,
    or the group's own where the table groups finer than by task (`group_id` is not the task id)."""
    if group_id is not None and group_id != eid.tid:
        return _escape(group_id)
    if str(eid.batch) == VERL_BATCH:
        return str(eid.task)
    return _escape(eid.tid)


def _escape(name: str) -> str:
    return name.replace("%", "%25").replace("_", "%5F")


def parse_key(key: str) -> tuple[str, int, int]:
    """(uid, session_id, index) of a trajectory key `{uid}_{session_id}_{index}`."""
    uid, session, index = key.rsplit("_", 2)
    return uid, int(session), int(index)


def _plain(value: Any, where: str) -> Any:
    """Plain data for TRXP's metadata (numpy and torch scalars and arrays become numbers and lists)."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist"):  # numpy and torch values
        return _plain(value.tolist(), where)
    raise ValueError(f"verl field {where} holds a {type(value).__name__}, which expbuf cannot store as plain data")


def from_verl(rows: list[Row]) -> list[Experience]:
    """Experiences of verl trajectory rows; the inverse of to_verl."""
    return [_experience(row) for row in rows]


def _experience(row: Row) -> Experience:
    f = row.fields
    uid, session, index = parse_key(row.key)
    if f.get("multi_modal_inputs"):
        raise ValueError(f"row {row.key}: multi-modal inputs need the model's processor (mrope positions)")
    tokens, prompt_length = layout.join(f["prompts"], f["responses"])
    n = int(f["responses"].shape[0])
    extra = dict(f.get("extra_fields") or {})
    info = {k: _plain(v, k) for k, v in f.items() if k not in _NOT_INFO}
    if "min_global_steps" in extra:
        info["model_version"] = _plain(extra.pop("min_global_steps"), "min_global_steps")
    if "max_global_steps" in extra:
        info["max_model_version"] = _plain(extra.pop("max_global_steps"), "max_global_steps")
    if "reward_extra_info" in extra:
        info["reward_extra_info"] = _plain(extra.pop("reward_extra_info"), "reward_extra_info")
    if extra:
        info["extra_fields"] = _plain(extra, "extra_fields")
    own = f.get("expbuf") or {}
    info.update(copy.deepcopy(own.get("info") or {}))  # the keys that would have written over the row's
    exp = Experience(
        tokens=tokens,
        eid=EID(**own["eid"]) if "eid" in own else EID(VERL_BATCH, uid, session, index, SUFFIX),
        prompt_length=prompt_length,
        action_mask=layout.response_tensor("response_mask", f["response_mask"], n).to(torch.bool),
        logprobs=layout.response_tensor("rollout_log_probs", f.get("rollout_log_probs"), n),
        advantages=layout.response_tensor("advantages", f.get("advantages"), n),
        returns=layout.response_tensor("returns", f.get("returns"), n),
        routed_experts=f.get("routed_experts"),
        info=info,
    )
    scores = f.get("rm_scores")
    if scores is not None:
        scores = layout.response_tensor("rm_scores", scores, n)
        last = None if own.get("token_level_reward") else layout.outcome_reward(scores)
        if last is None:
            exp.token_level_reward = scores
        exp.reward = own.get("reward", float(scores.sum()) if last is None else last)
    elif "reward" in own:
        exp.reward = own["reward"]
    if "info_keys" in own:  # the experience's own key order, so that its TRXP bytes come back the same
        exp.info = {k: exp.info[k] for k in own["info_keys"] if k in exp.info} | exp.info
    if own.get("no_action_mask"):
        exp.action_mask = None
    for name in _FOREIGN_META:
        if name in own:
            setattr(exp, name, copy.deepcopy(own[name]))
    if "metrics" in own:
        exp.metrics = dict(own["metrics"])
    elif "metrics" in f:
        info["metrics"] = _plain(f["metrics"], "metrics")
    return exp


def to_verl(experiences: list[Experience], group_ids: Sequence[str] | None = None) -> list[Row]:
    """verl trajectory rows of experiences (their sessions and indexes: `_places`). `group_ids` (a
    sampled batch's, one per experience) make each group of the table one verl uid."""
    if group_ids is not None and len(group_ids) != len(experiences):
        raise ValueError(f"{len(group_ids)} group ids for {len(experiences)} experiences; expected one each")
    groups = group_ids if group_ids is not None else [None] * len(experiences)
    places = _places(experiences, groups)
    return [_row(exp, *place, group) for exp, place, group in zip(experiences, places, groups, strict=True)]


def _from_verl(eid: EID, uid: str) -> bool:
    """Whether an experience is a verl trajectory's (its eid made by `from_verl`)."""
    return str(eid.batch) == VERL_BATCH and eid.suffix == SUFFIX and uid == str(eid.task)


def _places(experiences: list[Experience], groups: Sequence[str | None]) -> list[tuple[int, int]]:
    """Each experience's verl session and index. A verl trajectory's are its own. verl's GRPO takes
    a session's last index as its outcome, so the others get a session a run and their outputs in
    step order (ties in the order given); where two members of a group name one run and one step
    (a producer that tells its rollouts apart by suffix alone or leaves the run unset, or expbuf's
    TorchRL writers that share a round, each counting its own runs), a session each: one session
    made two rollouts turns of one, their GRPO group smaller than it was."""
    places: list[tuple[int, int]] = [(0, 0)] * len(experiences)
    foreign: dict[str, list[int]] = {}
    for at, (exp, group) in enumerate(zip(experiences, groups, strict=True)):
        uid = verl_uid(exp.eid, group)
        if _from_verl(exp.eid, uid):
            places[at] = (int(exp.eid.run), int(exp.eid.step))
        else:
            foreign.setdefault(uid, []).append(at)
    for members in foreign.values():
        runs_steps = {(int(experiences[at].eid.run), int(experiences[at].eid.step)) for at in members}
        if len(runs_steps) < len(members):
            for session, at in enumerate(members):
                places[at] = (session, 0)
            continue
        by_run: dict[int, list[int]] = {}
        for at in members:
            by_run.setdefault(int(experiences[at].eid.run), []).append(at)
        for run, ats in by_run.items():
            for index, at in enumerate(sorted(ats, key=lambda a: int(experiences[a].eid.step))):
                places[at] = (run, index)
    return places


def _row(exp: Experience, session: int, index: int, group_id: str | None = None) -> Row:
    for name in ("chosen", "rejected"):
        if getattr(exp, name, None) is not None:
            raise ValueError(f"experience {exp.eid.uid}: {name} (a DPO pair) has no field in verl's V1 trainer")
    if getattr(exp, "multi_modal_inputs", None):
        raise ValueError(f"experience {exp.eid.uid}: multi-modal inputs need the model's processor (mrope positions)")
    prompt, response = layout.split(exp.tokens, exp.prompt_length)
    n = int(response.shape[0])
    info = dict(exp.info or {})
    eid = exp.eid
    own: dict[str, Any] = {}
    uid = verl_uid(eid, group_id)
    if not _from_verl(eid, uid):  # its eid and info kept, for the way back (from_verl)
        own["eid"], own["info_keys"] = eid.to_dict(), list(info)
    mask = exp.action_mask
    if mask is None:  # verl needs a mask: all ones, remembered as absent
        mask, own["no_action_mask"] = torch.ones(n, dtype=torch.bool), True
    mask = layout.response_tensor("action_mask", mask, n).to(torch.int64)
    fields: dict[str, Any] = {
        "prompts": prompt.to(torch.int64),
        "responses": response.to(torch.int64),
        "response_mask": mask,
        "loss_mask": mask.clone(),
        "input_ids": exp.tokens.to(torch.int64),
        "position_ids": torch.arange(exp.tokens.shape[0], dtype=torch.int64),
        "multi_modal_inputs": {},  # what verl's agent loop writes for a text-only trajectory
    }
    for name, value in (("rollout_log_probs", exp.logprobs), ("advantages", exp.advantages), ("returns", exp.returns)):
        if value is not None:
            fields[name] = layout.response_tensor(name, value, n)
    if exp.routed_experts is not None:
        fields["routed_experts"] = exp.routed_experts
    level = exp.token_level_reward
    if level is not None:
        scores = layout.response_tensor("token_level_reward", level, n).to(torch.float32)
        fields["rm_scores"] = scores
        if layout.outcome_reward(scores) is not None or exp.reward != float(scores.sum()):
            own["token_level_reward"], own["reward"] = True, exp.reward
    elif exp.reward is not None:
        fields["rm_scores"] = layout.reward_at_last_token(exp.reward, n)
        if layout.outcome_reward(fields["rm_scores"]) != exp.reward:
            own["reward"] = exp.reward
    extra: dict[str, Any] = dict(info.pop("extra_fields", None) or {})
    if "model_version" in info:
        extra["min_global_steps"] = info.pop("model_version")
    if "max_model_version" in info:
        extra["max_global_steps"] = info.pop("max_model_version")
    if "reward_extra_info" in info:
        extra["reward_extra_info"] = info.pop("reward_extra_info")
    fields["extra_fields"] = extra
    if "metrics" in info:
        fields["metrics"] = info.pop("metrics")
    elif exp.metrics:
        fields["metrics"], own["metrics"] = dict(exp.metrics), dict(exp.metrics)
    fields["uid"], fields["session_id"] = uid, session
    clashing = [key for key in info if key in _NOT_INFO or key in fields]
    if clashing:  # a key of a row's own (verl groups rows by uid): kept apart, not written over the row's
        own["info"] = {key: copy.deepcopy(info.pop(key)) for key in clashing}
    fields.update(info)
    for name in _FOREIGN_META:
        value = getattr(exp, name, None)
        if value:
            own[name] = copy.deepcopy(value)
    if own:
        fields["expbuf"] = own
    steps = extra.get("min_global_steps")
    tag = {
        "status": "success",
        "prompt_len": int(prompt.shape[0]),
        "response_len": n,
        "seq_len": int(exp.tokens.shape[0]),
        "global_steps": info.get("global_steps", steps),
        "min_global_steps": steps,
        "max_global_steps": extra.get("max_global_steps", steps),
    }
    return Row(f"{uid}_{session}_{index}", tag, fields)
