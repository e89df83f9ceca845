"""The prompt ledger's calls (datasets, claims, their renewals and releases, prompt pages),
described as `Unary` calls (calls.py) for the blocking and the asyncio client."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

from expbuf.proto.v1 import buffer_pb2 as pb

from ..schema.prompts import MAX_PROMPTS_PER_CALL, Claim, DatasetInfo, Prompt, PromptPage
from .calls import Unary


def create_dataset(table: str, name: str, size: int, exist_ok: bool, settings: dict[str, Any]) -> Unary[DatasetInfo]:
    unknown = sorted(set(settings) - _DATASET_SETTINGS)
    if unknown:
        raise ValueError(
            f"create_dataset: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_DATASET_SETTINGS))}"
        )
    for key, value in {"size": size, **settings}.items():
        bounds = _DATASET_INTEGERS.get(key)
        if bounds and not (key == "seed" and value is None) and not _integer_in(value, *bounds):
            raise ValueError(f"create_dataset: {key} is {value!r}; it must be an integer in {bounds[0]}..{bounds[1]}")
    for key in ("on_drop", "order", "zero_variance"):
        if not isinstance(settings.get(key, ""), str):
            raise ValueError(f"create_dataset: {key} is {settings[key]!r}; it must be a name (a str)")
    options = settings.get("order_options", {})
    if not isinstance(options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in options.items()
    ):
        raise ValueError(f"create_dataset: order_options is {options!r}; it must map option names to numbers")
    seed = settings.get("seed")
    config = pb.DatasetConfig(
        name=name,
        size=size,
        epochs=settings.get("epochs", 1),
        max_in_flight=settings.get("max_in_flight", 0),
        on_drop=settings.get("on_drop", "done"),
        max_attempts=settings.get("max_attempts", 5),
        shards=settings.get("shards", ()),
        shard=settings.get("shard", ""),
        pass_threshold=_threshold(settings.get("pass_threshold", 0.0)),
        order=settings.get("order", "permutation"),
        order_options={key: float(value) for key, value in options.items()},
        zero_variance=settings.get("zero_variance", "keep"),
        skip_epochs=settings.get("skip_epochs", 1),
    )
    if seed is not None:
        config.seed = seed
    request = pb.CreateDatasetRequest(table=table, config=config, exist_ok=exist_ok)
    return Unary("CreateDataset", request, lambda r: DatasetInfo.from_proto(r.dataset, table), retry=exist_ok)


_DATASET_SETTINGS = frozenset(
    {"epochs", "seed", "max_in_flight", "on_drop", "max_attempts", "shards", "shard", "pass_threshold"}
    | {"order", "order_options", "zero_variance", "skip_epochs"}
)


def _threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"create_dataset: pass_threshold is {value!r}; it must be a number")
    return float(value)


# What the wire carries; an epochs or max_attempts of 0 would be read there as the default, not refused.
_DATASET_INTEGERS = {
    "size": (0, 2**64 - 1),
    "epochs": (1, 2**32 - 1),
    "seed": (-(2**63), 2**63 - 1),
    "max_in_flight": (0, 2**64 - 1),
    "max_attempts": (1, 2**32 - 1),
    "skip_epochs": (1, 2**32 - 1),
}


def _integer_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def datasets(table: str, name: str = "") -> Unary[list[DatasetInfo]]:
    request = pb.ListDatasetsRequest(table=table, name=name)
    return Unary("ListDatasets", request, lambda r: [DatasetInfo.from_proto(d, table) for d in r.datasets], retry=True)


def claim(
    table: str,
    dataset: str,
    count: int,
    lease_seconds: float,
    owner: str,
    wait: float,
    timeout: float,
    max_reply_bytes: int = 0,
) -> Unary[Claim]:
    """A Claim that says what this client receives (`max_reply_bytes`, its max_message_bytes), so
    that the server refuses a claim whose reply it could not take before claiming anything (0:
    the server's max_message_bytes alone bounds it)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"claim: count must be a positive integer, got {count!r}")
    request = pb.ClaimRequest(
        table=table, dataset=dataset, count=count, lease_seconds=lease_seconds, owner=owner, wait_seconds=wait,
        max_reply_bytes=max_reply_bytes,
    )  # fmt: skip

    def read(reply: pb.ClaimReply) -> Claim:
        return Claim([Prompt.from_proto(p, table) for p in reply.prompts], reply.done)

    return Unary("Claim", request, read, retry=False, timeout=wait + timeout)


def _refs(prompts: list[Prompt]) -> list[pb.PromptRef]:
    return [pb.PromptRef(epoch=p.epoch, index=p.index, attempt=p.attempt) for p in prompts]


def by_dataset(prompts: Iterable[Prompt]) -> list[tuple[tuple[str, str], list[Prompt]]]:
    """Prompts by (table, dataset), in parts of at most MAX_PROMPTS_PER_CALL: one call each."""
    out: dict[tuple[str, str], list[Prompt]] = {}
    for prompt in prompts:
        out.setdefault((prompt.table, prompt.dataset), []).append(prompt)
    return [
        (key, part[start : start + MAX_PROMPTS_PER_CALL])
        for key, part in out.items()
        for start in range(0, len(part), MAX_PROMPTS_PER_CALL)
    ]


def renew_claims(table: str, dataset: str, prompts: list[Prompt], seconds: float) -> Unary[tuple[float, list[Prompt]]]:
    request = pb.RenewClaimsRequest(table=table, dataset=dataset, prompts=_refs(prompts), lease_seconds=seconds)

    def read(reply: pb.RenewClaimsReply) -> tuple[float, list[Prompt]]:
        ended = {(r.epoch, r.index, r.attempt) for r in reply.ended}
        return reply.expires_unix, [p for p in prompts if (p.epoch, p.index, p.attempt) in ended]

    return Unary("RenewClaims", request, read, retry=True)


def release_claims(table: str, dataset: str, prompts: list[Prompt]) -> Unary[int]:
    request = pb.ReleaseClaimsRequest(table=table, dataset=dataset, prompts=_refs(prompts))
    return Unary("ReleaseClaims", request, lambda r: r.released, retry=True)


Outcomes = Mapping[Prompt, Sequence[float]] | Iterable[tuple[Prompt, Sequence[float]]]


def outcomes_by_dataset(outcomes: Outcomes) -> list[tuple[tuple[str, str], list[tuple[Prompt, list[float]]]]]:
    """Prompts and their runs' rewards by (table, dataset), in parts of at most
    MAX_PROMPTS_PER_CALL; a reward that is not a finite number, or a prompt without one, is a
    ValueError naming the prompt, before anything is sent."""
    pairs = outcomes.items() if isinstance(outcomes, Mapping) else outcomes
    rewards: dict[Prompt, list[float]] = {}
    for prompt, given in pairs:
        values = list(given) if isinstance(given, Iterable) and not isinstance(given, str | bytes) else []
        if not values or not all(isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ValueError(
                f"report_prompts: prompt {prompt.dataset}/{prompt.epoch}/{prompt.index} has rewards {given!r};"
                " give the rewards of its runs, a list of one finite number or more"
            )
        rewards[prompt] = [float(v) for v in values]
    return [(key, [(prompt, rewards[prompt]) for prompt in part]) for key, part in by_dataset(rewards)]


def report_prompts(table: str, dataset: str, outcomes: list[tuple[Prompt, list[float]]]) -> Unary[int]:
    refs = _refs([prompt for prompt, _ in outcomes])
    request = pb.ReportPromptsRequest(
        table=table,
        dataset=dataset,
        outcomes=[
            pb.PromptOutcome(prompt=ref, rewards=rewards) for ref, (_, rewards) in zip(refs, outcomes, strict=True)
        ],
    )
    return Unary("ReportPrompts", request, lambda r: r.reported, retry=True)


def list_prompts(
    table: str, dataset: str, states: Iterable[str], after: tuple[int, int] | None, limit: int
) -> Unary[PromptPage]:
    request = pb.ListPromptsRequest(table=table, dataset=dataset, states=list(states), limit=limit)
    if after is not None:
        request.has_after, request.after_epoch, request.after_index = True, after[0], after[1]

    def read(reply: pb.ListPromptsReply) -> PromptPage:
        prompts = [Prompt.from_proto(p, table) for p in reply.prompts]
        # A page that is not the last read `limit` records, whether or not it kept any of `states`.
        last = (reply.after_epoch, reply.after_index) if (prompts or after is not None or not reply.done) else None
        return PromptPage(prompts, last, reply.done)

    return Unary("ListPrompts", request, read, retry=True)
