"""expbuf's own Experience and EID, field-compatible with Trinity-RFT's.

Users without Trinity build these; users with Trinity pass their own objects,
which the codec reads by attribute name (duck typing).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Tensors whose length is the response length (tokens after the prompt).
RESPONSE_TENSOR_FIELDS = (
    "logprobs",
    "advantages",
    "returns",
    "action_mask",
    "token_level_reward",
    "teacher_logprobs",
)
# Tensors of token ids.
TOKEN_TENSOR_FIELDS = ("tokens", "chosen", "rejected")
TENSOR_FIELDS = (
    "tokens",
    "logprobs",
    "token_level_reward",
    "advantages",
    "returns",
    "action_mask",
    "chosen",
    "rejected",
    "teacher_logprobs",
    "routed_experts",
)
# Plain-data fields of an item, in the order Trinity-RFT writes them.
META_FIELDS = (
    "reward",
    "truncate_status",
    "info",
    "metrics",
    "prompt_length",
    "response_text",
    "prompt_text",
    "messages",
    "tools",
    "chosen_messages",
    "rejected_messages",
)


def ordered_id() -> str:
    """A new id, unique in practice, whose text sorts in the order ids were made (within a process;
    across hosts as far as their clocks agree): 16 hex digits of the time in nanoseconds, then 8 of
    random. A table keeps its experiences' payloads by uid, so uids made this way land together at
    the end of its B-trees, where uids in no order (a uuid4) cost its store a leaf written for each
    (bench/RESULTS.md, "The order of a table's uids"); 32 random bits beside the time keep ids made
    in the same nanosecond apart, and a clock read that is not past the last one made here takes the
    nanosecond after it, so that a process's ids sort as they were made."""
    now = max(time.time_ns(), _LAST_ID_TIME[0] + 1)
    _LAST_ID_TIME[0] = now
    return f"{now:016x}{secrets.randbits(32):08x}"


_LAST_ID_TIME = [0]  # the time part of the last ordered_id made in this process


@dataclass(init=False)
class EID:
    """Identity of an experience: uid = batch/task/run/step/suffix, Trinity-RFT's parts and defaults
    (batch and task empty, run and step 0).

    `batch` may itself contain '/' (e.g. "3/eval_math"), so the parts are kept
    separately; task and suffix may not (the decoder refuses them), so that two
    different eids never share a uid.

    Without a `suffix`, an eid that names a batch or a task gets an empty one: the same parts
    make the same uid every time, so a rollout built again and pushed is a duplicate (or, with
    other content, refused by its uid), never a second run. One that names neither (no eid: an
    experience of a table that does not group) gets a new `ordered_id`, so that each is an
    experience of its own: Trinity-RFT's EID draws 6 random hex digits, which two of some
    thousands share (a push of one refused as a conflict with the other), and in no order.
    """

    batch: int | str
    task: int | str
    run: int
    step: int
    suffix: str

    def __init__(
        self, batch: int | str = "", task: int | str = "", run: int = 0, step: int = 0, suffix: str | None = None
    ) -> None:
        self.batch = batch
        self.task = task
        self.run = run
        self.step = step
        named = batch != "" or task != ""
        self.suffix = suffix if suffix is not None else "" if named else ordered_id()

    @property
    def uid(self) -> str:
        return f"{self.batch}/{self.task}/{self.run}/{self.step}/{self.suffix}"

    @property
    def tid(self) -> str:
        """Task id: all runs of one task (a GRPO group)."""
        return f"{self.batch}/{self.task}"

    @property
    def rid(self) -> str:
        """Run id: all steps of one run of a task."""
        return f"{self.batch}/{self.task}/{self.run}"

    @property
    def sid(self) -> str:
        """Step id: all runs of a task at one step."""
        return f"{self.batch}/{self.task}/{self.step}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "task": self.task,
            "run": self.run,
            "step": self.step,
            "suffix": self.suffix,
        }

    def __str__(self) -> str:
        return self.uid


def ids_of(parts: Mapping[str, Any], uid: str | None = None) -> tuple[str, str, str, str]:
    """An eid's uid, tid, rid and sid from its parts as a dict (`EID.to_dict`'s), as EID's properties
    make them, without an EID made first: a push makes them for every experience. An eid missing a
    part, or with a suffix of None, is EID's to fill in. `uid`, where given, is the one EID makes of
    these parts, already made by the check of a pushed experience (which found task and suffix free
    of '/'): the others are read from it from the right (run and step are ints), not made again."""
    if uid is not None:
        task_id, run, step, _ = uid.rsplit("/", 3)
        return uid, task_id, uid[: len(task_id) + 1 + len(run)], f"{task_id}/{step}"
    try:
        task_id, run, step, suffix = f"{parts['batch']}/{parts['task']}", parts["run"], parts["step"], parts["suffix"]
    except KeyError:
        suffix = None
    if suffix is None:
        eid = EID(**parts)
        return eid.uid, eid.tid, eid.rid, eid.sid
    run_id = f"{task_id}/{run}"
    return f"{run_id}/{step}/{suffix}", task_id, run_id, f"{task_id}/{step}"


# An eid's parts in its uid's order: the keys of an eid written as a dict (a payload's metadata,
# a push's columns).
EID_PARTS = tuple(part.name for part in fields(EID))


@dataclass
class Experience:
    """One rollout experience, with the fields of Trinity-RFT's Experience."""

    tokens: torch.Tensor
    eid: EID = field(default_factory=EID)
    prompt_length: int = 1
    reward: float | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    token_level_reward: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    chosen: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    truncate_status: str | None = None
    response_text: str | None = None
    prompt_text: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    chosen_messages: list[dict] | None = None
    rejected_messages: list[dict] | None = None
    custom_fields: list[dict[str, str]] = field(default_factory=list)
    multi_modal_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def model_version(self) -> int | None:
        """Policy version that produced this experience (info["model_version"])."""
        return self.info.get("model_version")

    @property
    def version_segments(self) -> list[list[int]] | None:
        """The policy version of each part of the response: [[version, offset], ...], each the
        version that generated the tokens from offset (0 = the first after the prompt) on
        (info["version_segments"]); None where one version generated them all."""
        return self.info.get("version_segments")
