"""The prompt ledger over shards: the plans of the sharded clients' dataset and claim calls.

A dataset's prompts are placed as their groups are (routing.py): the group of every attempt
at prompt `index` of epoch `epoch` goes to the rendezvous of `name/epoch/index` over the shards
of the map's first epoch, and that shard hands the prompt out (server/store/ledger/shards.py).
So `create_dataset` creates the dataset on each of those shards, naming them all and the one
asked, and splits `max_in_flight` among them. A claim asks them for parts of its count, from a
start that turns with each claim so that one-prompt claims spread over the shards, and asks
those that gave their whole part for the rest; a shard that is down is left out and its prompts
wait for it. A claim that found nothing waits on the shards not yet done, in slices, each
slice asking them in parallel for parts of the count (with a pause when all those asked are
down, as a sample's poll pauses). It is `done` once every shard says so.
Renewals and releases go to each prompt's shard; `ledger` and `datasets` merge the shards'
counts (DatasetInfo.merged), naming in `missing` the shards that did not answer; `list_prompts`
merges the shards' pages in (epoch, index) order.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..errors import BufferError
from ..rpc.calls.ledger_calls import Outcomes, outcomes_by_dataset
from ..rpc.declare import waited
from ..schema.prompts import DEFAULT_PAGE, MAX_PROMPTS_PER_CALL, Claim, DatasetInfo, Prompt, PromptPage, new_claim_id
from .common import shard_error
from .plans import Planned
from .poll import POLL_SECONDS, Wait
from .steps import Call, Plan, is_down

# A waiting claim asks again this often, in turn, so that a prompt freed on a shard the slice did
# not ask goes out within a few slices.
WAIT_SLICE = 1.0


def spread(count: int, shards: Sequence[str]) -> dict[str, int]:
    """`count` split as evenly as can be over the shards, the first ones taking one more."""
    share, extra = divmod(count, len(shards))
    parts = {shard: share + (turn < extra) for turn, shard in enumerate(shards)}
    return {shard: part for shard, part in parts.items() if part}


def turned(shards: Sequence[str], turn: int) -> list[str]:
    """The shards from the one whose turn it is, round."""
    start = turn % len(shards)
    return [*shards[start:], *shards[:start]]


def bounds(max_in_flight: Any, shards: Sequence[str]) -> dict[str, Any]:
    """A dataset's max_in_flight split among its shards, at least 1 each (0: no bound on any).
    A value that is not a positive integer goes to every shard as it is, to be refused there."""
    if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight <= 0:
        return dict.fromkeys(shards, max_in_flight)
    share, extra = divmod(max_in_flight, len(shards))
    return {shard: max(1, share + (turn < extra)) for turn, shard in enumerate(shards)}


def merge_pages(pages: Sequence[PromptPage], limit: int) -> PromptPage:
    """One page of the shards' pages in (epoch, index) order: it ends where the first shard's
    page that is not its last ended (the others' prompts past it come on the next page), or at
    `limit` prompts, so that paging on misses and repeats none."""
    ends = [page.after for page in pages if not page.done and page.after is not None]
    cut = min(ends, default=None)
    rows = sorted((p for page in pages for p in page.prompts), key=lambda p: (p.epoch, p.index))
    if cut is not None:
        rows = [p for p in rows if (p.epoch, p.index) <= cut]
    if len(rows) > limit:
        rows = rows[:limit]
        cut = (rows[-1].epoch, rows[-1].index)
    if cut is not None:
        return PromptPage(rows, cut, False)
    return PromptPage(rows, max((page.after for page in pages if page.after is not None), default=None), True)


def claim_in_bounds(count: object, wait: object) -> None:
    """Refuse a claim's count or wait as one server does, before any shard is asked: the shards'
    parts of a count past MAX_PROMPTS_PER_CALL each fit, and a negative wait is sent to none."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PROMPTS_PER_CALL:
        raise ValueError(f"claim: count is {count!r}; a claim asks for 1 to {MAX_PROMPTS_PER_CALL} prompts")
    waited("claim", wait)


@dataclass
class _Claiming:
    """What one claim gathered: its prompts, the shards that said done, answered, or were down;
    and each shard's claims answered, which name the id its next claim is made under (`claim_id`)."""

    base: str
    got: list[Prompt] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    down: dict[str, BufferError] = field(default_factory=dict)
    asks: dict[str, int] = field(default_factory=dict)

    def claim_id(self, shard: str) -> str:
        """The id of the shard's next claim: the same until the shard answers one (a claim whose
        reply was lost is made again under its id, and answered with what it handed out), then
        another; the same for a call made again with the same `claim_id`."""
        key = f"{self.base}\0{shard}\0{self.asks.get(shard, 0)}".encode()
        return hashlib.blake2b(key, digest_size=16).hexdigest()


class LedgerPlans(Planned):
    """The ledger's plans, over the shards of the map's first epoch (sorted by name)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turn = 0

    def ledger_shards(self) -> list[str]:
        """The shards that hold datasets: the first epoch's, for good (a dataset's name is no number)."""
        return sorted(self.shard_map.epochs[0].shards)

    def _create_dataset(
        self, table: str, name: str, size: int, exist_ok: bool, settings: dict[str, Any]
    ) -> Plan[DatasetInfo]:
        """On every shard of the first epoch; with exist_ok, a shard that cannot be reached is owed
        it. One that does not answer in time is not: counting its part took longer than the
        client's timeout, and would again (raise the timeout)."""
        placed = sorted({"shards", "shard"} & set(settings))
        if placed:
            raise ValueError(f"create_dataset: {' and '.join(placed)} are the sharded client's to set")
        shards = self.ledger_shards()
        limits = bounds(settings.get("max_in_flight", 0), shards)
        own = {s: {**settings, "max_in_flight": limits[s], "shards": shards, "shard": s} for s in shards}
        calls = [Call(s, "create_dataset", (table, name, size), {"exist_ok": exist_ok, **own[s]}, None) for s in shards]
        infos, errors = self._sort(calls, (yield from self._exchange(calls)))
        unreachable = {s: exc for s, exc in errors.items() if exc.code == grpc.StatusCode.UNAVAILABLE}
        missing = unreachable if exist_ok else {}
        for shard in missing:
            self._owed.dataset(shard, table, name, size, own[shard])
        refused = {shard: exc for shard, exc in errors.items() if shard not in missing}
        if refused or not infos:
            raise shard_error(refused or missing, self.shard_map.targets, infos)
        return DatasetInfo.merged(list(infos.values()), {shard: str(exc) for shard, exc in missing.items()})

    def _datasets(self, table: str) -> Plan[list[DatasetInfo]]:
        per_shard = yield from self._live_on(self.ledger_shards(), "datasets", table)
        parts: dict[str, list[DatasetInfo]] = {}
        for infos in per_shard.values():
            for info in infos:
                parts.setdefault(info.name, []).append(info)
        merged = []
        for name, part in sorted(parts.items()):
            held = {info.shard for info in part}
            lacking = {  # made while they were down, by a client that owed it them and is gone
                shard: f"shard {shard} has no dataset {name!r} of its shards' (created while it was down?): "
                "create_dataset(..., exist_ok=True) again makes its part there"
                for shard in part[0].shards
                if shard in per_shard and shard not in held
            }
            merged.append(DatasetInfo.merged(part, {**per_shard.missing, **lacking}))
        return merged

    def _ledger(self, table: str, dataset: str) -> Plan[DatasetInfo]:
        per_shard = yield from self._live_on(self.ledger_shards(), "ledger", table, dataset)
        return DatasetInfo.merged(list(per_shard.values()), per_shard.missing)

    # ---- claims ------------------------------------------------------------------------------

    def _claim(
        self, table: str, dataset: str, count: int, lease_seconds: float, owner: str, wait: float, claim_id: str
    ) -> Plan[Claim]:
        """Prompts from every shard that has some now; else, up to `wait`, from the first that has."""
        claim_in_bounds(count, wait)
        deadline = time.monotonic() + wait
        shards = self.ledger_shards()
        turn, self._turn = self._turn, self._turn + 1
        ask = {"lease_seconds": lease_seconds, "owner": owner}
        state = _Claiming(claim_id or new_claim_id())
        remaining = turned(shards, turn)
        while remaining and len(state.got) < count:  # those that gave their whole part may have more
            parts = spread(count - len(state.got), remaining)
            gave = yield from self._claim_parts(table, dataset, parts, ask, state)
            remaining = [s for s in remaining if s not in parts or gave.get(s) == parts[s]]
        pause = POLL_SECONDS[0]
        while not state.got and len(state.done) < len(shards) and (left := deadline - time.monotonic()) > 0:
            turn += 1
            waiting = turned([s for s in shards if s not in state.done], turn)
            slice_ = {**ask, "wait": min(left, WAIT_SLICE)}
            if not (yield from self._claim_parts(table, dataset, spread(count, waiting), slice_, state)):
                yield Wait(min(pause, left))  # every shard asked is down: they answer at once, do not spin
                pause = min(pause * 2, POLL_SECONDS[1])
        if not state.answered:
            raise shard_error(state.down, self.shard_map.targets, Claim([], False))
        return Claim(state.got, not state.got and len(state.done) == len(shards))

    def _claim_parts(
        self, table: str, dataset: str, parts: dict[str, int], ask: dict[str, Any], state: _Claiming
    ) -> Plan[dict[str, int]]:
        """Claim each shard's part in parallel; what each gave. A shard that refuses fails the
        claim (ShardError, its `result` the Claim of what the others gave: release it, or use it)."""
        calls = [
            Call(shard, "claim", (table, dataset, part), {**ask, "claim_id": state.claim_id(shard)}, quick=None)
            for shard, part in parts.items()
        ]
        claims, errors = self._sort(calls, (yield from self._exchange(calls)))
        for shard, claim in claims.items():
            state.asks[shard] = state.asks.get(shard, 0) + 1
            state.answered.add(shard)
            state.down.pop(shard, None)
            state.got += claim.prompts
            if claim.done:
                state.done.add(shard)
        state.down.update((shard, exc) for shard, exc in errors.items() if is_down(exc))
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        if refused:
            raise shard_error(refused, self.shard_map.targets, Claim(state.got, False))
        return {shard: len(claim.prompts) for shard, claim in claims.items()}

    def _by_shard(self, prompts: Iterable[Prompt]) -> dict[str, list[Prompt]]:
        """Prompts by the shard that holds them: the owner of their groups."""
        parts: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            parts.setdefault(self.shard_map.owner(prompt.group), []).append(prompt)
        return parts

    def _renew_claims(self, prompts: Iterable[Prompt], seconds: float) -> Plan[list[Prompt]]:
        """Each prompt's claim renewed on its shard; the prompts whose claim had ended. Raises
        ShardError naming a shard that failed, its `result` the ended prompts of the others."""
        prompts = list(prompts)
        calls = [Call(s, "renew_claims", (part, seconds), quick=None) for s, part in self._by_shard(prompts).items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        ended = {prompt for part in results.values() for prompt in part}
        out = [prompt for prompt in prompts if prompt in ended]
        if errors:
            raise shard_error(errors, self.shard_map.targets, out)
        return out

    def _release_claims(self, prompts: Iterable[Prompt]) -> Plan[int]:
        """Each prompt's claim given back on its shard; how many were held. Raises ShardError
        naming a shard that failed, its `result` how many the others released."""
        calls = [Call(s, "release_claims", (part,), quick=None) for s, part in self._by_shard(prompts).items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        if errors:
            raise shard_error(errors, self.shard_map.targets, sum(results.values()))
        return sum(results.values())

    def _report_prompts(self, outcomes: Outcomes) -> Plan[int]:
        """Each prompt's outcome reported on its shard; how many were trained. Raises ShardError
        naming a shard that failed, its `result` how many the others took."""
        parts: dict[str, dict[Prompt, list[float]]] = {}
        for (_, _), part in outcomes_by_dataset(outcomes):
            for prompt, rewards in part:
                parts.setdefault(self.shard_map.owner(prompt.group), {})[prompt] = rewards
        calls = [Call(s, "report_prompts", (part,), quick=None) for s, part in parts.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        if errors:
            raise shard_error(errors, self.shard_map.targets, sum(results.values()))
        return sum(results.values())

    def _list_prompts(
        self, table: str, dataset: str, states: Iterable[str], after: tuple[int, int] | None, limit: int
    ) -> Plan[PromptPage]:
        """A page merged over every shard; one that does not answer fails it (ShardError): a page
        without its prompts would skip them."""
        limit = limit or DEFAULT_PAGE  # 0 on the wire: the server's default page
        kwargs = {"states": list(states), "after": after, "limit": limit}
        calls = [Call(s, "list_prompts", (table, dataset), kwargs, quick=None) for s in self.ledger_shards()]
        pages, errors = self._sort(calls, (yield from self._exchange(calls)))
        if errors:
            raise shard_error(errors, self.shard_map.targets)
        return merge_pages(list(pages.values()), limit)
