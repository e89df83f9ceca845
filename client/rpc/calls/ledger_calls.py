"""The prompt ledger's calls as the clients make them (PromptCalls, declared once: rpc/declare.py):
datasets of prompts, claims on them, their renewals and releases, outcomes reported, pages of
prompts. Sharded, a dataset's prompts live on the shards of the map's first epoch, each handing out
its part (shards/ledger.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from numbers import Real
from typing import Any

from expbuf.proto.v1 import buffer_pb2 as pb

from ...schema.prompts import (
    DEFAULT_PAGE,
    MAX_CLAIM_ID_BYTES,
    MAX_PROMPTS_PER_CALL,
    Claim,
    DatasetInfo,
    Prompt,
    PromptPage,
    new_claim_id,
)
from ..declare import ClientSettings, Plan, Steps, Unary, declare, waited

Outcomes = Mapping[Prompt, Sequence[float]] | Iterable[tuple[Prompt, Sequence[float]]]


class PromptCalls(ClientSettings):
    """The prompt ledger's calls, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._create_dataset)
    def create_dataset(  # `self` positional-only: a setting may have any name
        self, /, table: str, name: str, size: int, *, exist_ok: bool = False, **settings: Any
    ) -> Plan[DatasetInfo]:
        """A dataset of `size` prompts (indexes 0..size-1) on a table that groups by task.
        ClientSettings: `epochs` (1), `seed` (each epoch in a permutation fixed by it; None: index
        order), `max_in_flight` (bound on prompts claimed, or generated and not yet trained; 0:
        none), `on_drop` ("done": a group the table drops counts its prompt as done; "retry":
        it goes out again), `max_attempts` (5: a prompt sent back this often is dropped),
        `pass_threshold` (0.0: a run passes when its reward is above it, in each prompt's statistics,
        which `list_prompts` returns), `order` ("permutation"; "pools": by the last group's mean
        reward, easy / medium / hard with shares; "pass_rate": near a target pass rate first) and
        its `order_options`, `zero_variance` ("keep"; "retry": claimed again; "skip": sits out the
        next `skip_epochs` epochs). docs/concepts/prompt-ledger.md shows a curriculum.

        Sharded: on every shard of the map's first epoch, each handing out its part;
        `max_in_flight` is split among them (at least 1 each). With exist_ok, a shard that does
        not answer is owed the dataset (`pending`) and named in `.missing`."""
        request = pb.CreateDatasetRequest(table=table, config=_dataset(name, size, settings), exist_ok=exist_ok)
        return Unary("CreateDataset", request, lambda r: DatasetInfo.from_proto(r.dataset, table), retry=exist_ok)

    @declare(shards=lambda s: s._datasets)
    def datasets(self, table: str = "default") -> Plan[list[DatasetInfo]]:
        """The table's datasets, each with its cursor and its prompts by state and epoch.
        Sharded: each merged over the shards that answer (`.missing`: the others)."""
        return _datasets(table)

    @declare(shards=lambda s: s._ledger)
    def ledger(self, table: str, dataset: str) -> Steps[DatasetInfo]:
        """One dataset's settings, cursor and prompts by state and epoch. Sharded: its counts
        merged over the shards that answer (`.missing`: the others)."""
        (info,) = yield _datasets(table, dataset)
        return info

    @declare(shards=lambda s: s._claim)
    def claim(
        self,
        table: str,
        dataset: str,
        count: int = 1,
        *,
        lease_seconds: float = 300.0,
        owner: str = "",
        wait: float = 0.0,
        claim_id: str = "",
    ) -> Plan[Claim]:
        """Up to `count` prompts for this rollout worker, under claims that end `lease_seconds`
        from now unless renewed; prompts sent back go out before new ones. Waits up to `wait`
        seconds when none can be handed out now (max_in_flight reached, or every prompt out),
        asking again while the server has as many claims waiting as it lets (calls.Attempts).
        `done` says the dataset has nothing left to hand out or train. `count` is at most
        MAX_PROMPTS_PER_CALL (expbuf.client.schema.prompts), and at most what one reply holds
        within this client's `max_message_bytes`: a claim of more is refused, before anything
        is claimed, with ResourceExhaustedError (reason `too_large`) naming the count that fits.

        A claim whose reply is lost (a cut connection, a restarted server) is made again, under
        the id this call gives it (`claim_id`, or a new one): the server answers it with the
        prompts it handed out the first time and still holds, claiming no more. A caller that
        makes a claim again itself (its own retries) passes the same `claim_id` to each try.

        Sharded: from the shards that have some, a shard that is down left out (its prompts wait
        for it); with none now, waits up to `wait` for one. `done` once every shard says its part
        is done. A shard that refuses raises ShardError, its `result` the Claim of what the others
        gave."""
        return claim_call(
            table, dataset, count, lease_seconds, owner, wait, self.timeout, self.max_message_bytes, claim_id
        )

    @declare(shards=lambda s: s._renew_claims)
    def renew_claims(self, prompts: Iterable[Prompt], seconds: float) -> Steps[list[Prompt]]:
        """Claims now end `seconds` from now; returns the prompts whose claim had already ended
        (not renewed: their groups will not be taken, give up on them). Any number, in calls of
        at most MAX_PROMPTS_PER_CALL. Sharded: each prompt on its shard (ShardError: `result` the
        ended prompts of the shards that answered)."""
        ended: list[Prompt] = []
        for (table, dataset), part in by_dataset(prompts):
            request = pb.RenewClaimsRequest(table=table, dataset=dataset, prompts=_refs(part), lease_seconds=seconds)
            ended += yield Unary("RenewClaims", request, partial(_ended, part), retry=True)
        return ended

    @declare(shards=lambda s: s._release_claims)
    def release_claims(self, prompts: Iterable[Prompt]) -> Steps[int]:
        """Give claims back now: each prompt goes out again with its next attempt. Returns the
        claims that were still held (a release made again after its reply was lost, as the client's
        retries make it, counts none of those the first released: they are not held then). Any
        number, in calls of at most MAX_PROMPTS_PER_CALL.
        Sharded: each prompt on its shard (ShardError: `result` what the shards that answered
        released)."""
        released = 0
        for (table, dataset), part in by_dataset(prompts):
            request = pb.ReleaseClaimsRequest(table=table, dataset=dataset, prompts=_refs(part))
            released += yield Unary("ReleaseClaims", request, lambda r: r.released, retry=True)
        return released

    @declare(shards=lambda s: s._report_prompts)
    def report_prompts(self, outcomes: Outcomes) -> Steps[int]:
        """Prompts whose groups were generated and trained outside expbuf (a framework's own queue
        held their runs), each with its runs' rewards (`{prompt: [rewards]}` or pairs): each
        prompt still claimed is trained, its statistics taking the rewards, so a claim order
        learns from them. Returns the prompts whose claims still held (and those trained at that
        attempt already: a report made again after its reply was lost). A prompt whose group is in
        the table is refused (AlreadyExistsError): its group's events move it. Sharded: each
        prompt on its shard (ShardError: `result` what the shards that answered took)."""
        reported = 0
        for (table, dataset), part in outcomes_by_dataset(outcomes):
            refs = _refs([prompt for prompt, _ in part])
            request = pb.ReportPromptsRequest(
                table=table,
                dataset=dataset,
                outcomes=[
                    pb.PromptOutcome(prompt=ref, rewards=rewards) for ref, (_, rewards) in zip(refs, part, strict=True)
                ],
            )
            reported += yield Unary("ReportPrompts", request, lambda r: r.reported, retry=True)
        return reported

    @declare(shards=lambda s: s._list_prompts)
    def list_prompts(
        self,
        table: str,
        dataset: str,
        *,
        states: Iterable[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = DEFAULT_PAGE,
    ) -> Plan[PromptPage]:
        """A page of the dataset's prompts handed out at least once, in (epoch, index) order, of
        `states` (all when empty); pass the page's `after` for the next. Sharded: merged over its
        shards in (epoch, index) order, at most `limit`; every shard must answer."""
        request = pb.ListPromptsRequest(table=table, dataset=dataset, states=list(states), limit=limit)
        if after is not None:
            request.has_after, request.after_epoch, request.after_index = True, after[0], after[1]

        def read(reply: pb.ListPromptsReply) -> PromptPage:
            prompts = [Prompt.from_proto(p, table) for p in reply.prompts]
            # A page that is not the last read `limit` records, whether or not it kept any of `states`.
            last = (reply.after_epoch, reply.after_index) if (prompts or after is not None or not reply.done) else None
            return PromptPage(prompts, last, reply.done)

        return Unary("ListPrompts", request, read, retry=True)


def _dataset(name: str, size: int, settings: dict[str, Any]) -> pb.DatasetConfig:
    """A dataset's settings as the wire carries them, each checked: a ValueError names one that is
    unknown or out of its range before anything is sent."""
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
    return config


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


def _datasets(table: str, name: str = "") -> Unary[list[DatasetInfo]]:
    request = pb.ListDatasetsRequest(table=table, name=name)
    return Unary("ListDatasets", request, lambda r: [DatasetInfo.from_proto(d, table) for d in r.datasets], retry=True)


def claim_call(
    table: str,
    dataset: str,
    count: int,
    lease_seconds: float,
    owner: str,
    wait: float,
    timeout: float,
    max_reply_bytes: int = 0,
    claim_id: str = "",
) -> Unary[Claim]:
    """The Claim call of PromptCalls.claim, which says what this client receives
    (`max_reply_bytes`, its max_message_bytes), so that the server refuses a claim whose reply it
    could not take before claiming anything (0: the server's max_message_bytes alone bounds it).
    Made again under the retry policy with its id (a new one where none is given): the server
    answers a repeat with what the first handed out, so a lost reply claims nothing twice."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"claim: count must be a positive integer, got {count!r}")
    wait = waited("claim", wait)
    if not isinstance(claim_id, str) or len(claim_id.encode()) > MAX_CLAIM_ID_BYTES:
        raise ValueError(f"claim: claim_id must be a str of at most {MAX_CLAIM_ID_BYTES} bytes, got {claim_id!r}")
    request = pb.ClaimRequest(
        table=table, dataset=dataset, count=count, lease_seconds=lease_seconds, owner=owner, wait_seconds=wait,
        max_reply_bytes=max_reply_bytes, claim_id=claim_id or new_claim_id(),
    )  # fmt: skip

    def read(reply: pb.ClaimReply) -> Claim:
        return Claim([Prompt.from_proto(p, table) for p in reply.prompts], reply.done)

    return Unary("Claim", request, read, retry=True, timeout=wait + timeout, remembered=True)


def _refs(prompts: list[Prompt]) -> list[pb.PromptRef]:
    return [pb.PromptRef(epoch=p.epoch, index=p.index, attempt=p.attempt) for p in prompts]


def _ended(prompts: list[Prompt], reply: pb.RenewClaimsReply) -> list[Prompt]:
    """The prompts of a RenewClaims whose claim had ended."""
    ended = {(r.epoch, r.index, r.attempt) for r in reply.ended}
    return [p for p in prompts if (p.epoch, p.index, p.attempt) in ended]


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
