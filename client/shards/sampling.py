"""The sharded clients' sample: batches drawn from every shard in proportion to what each holds
ready (poll.Poll), each shard's part held unconfirmed on its own stream until the whole batch is in
hand, a shard's refusal failing the sample with the other shards' parts given back uncounted.
A plan, as plans.py's: the blocking and the asyncio client run it."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Protocol

from ..errors import BufferError
from ..results import Batch, Leases
from ..rpc.sample_spec import SampleSpec
from .common import ShardBatch, shard_error
from .plans import Planned
from .poll import POLL_SECONDS, Ask, Done, GiveUp, Poll, Wait
from .steps import Call, Emit, Plan, is_down

_log = logging.getLogger("expbuf.client")


class Held(Protocol):
    """A shard's part of a batch, received and not confirmed (the one-server clients' HeldBatch
    and AsyncHeldBatch): its shard holds it, counted nowhere, until its `deliver` or `give_back`."""

    batch: Batch
    due: float  # the last moment (time.monotonic()) its confirmation may go (calls.confirm_by)


Parts = list[tuple[str, Held]]


class SamplePlans(Planned):
    """The plan of a sample over shards."""

    def _sample(self, spec: SampleSpec, leases: Leases, kind: type[ShardBatch]) -> Plan[None]:
        """Batches drawn from every shard in proportion to what each holds ready, as Poll decides.

        Each shard's part is taken on a stream of its own and held there unconfirmed (`_hold`):
        its shard neither consumes it, nor starts its lease, nor counts its replay until the whole
        batch is in hand and every part is confirmed (`_deliver`). A shard that refuses its part
        (its table's streams all taken, a part it cannot decode...) fails the sample at once with
        that refusal, as one server's would, and the parts the other shards handed over for the
        batch go back to their buffers (`_give_back`) as if never taken: not counted as sampled,
        nor against max_times_sampled, as the caller never had them."""
        if spec.trainer_version is not None:  # every shard, the admission shard too
            yield from self._set_trainer_version(spec.trainer_version, spec.table, need_answer=False)
        sent = 0
        while not spec.max_batches or sent < spec.max_batches:
            poll = Poll(spec, self.clients, time.monotonic())
            parts: Parts = []
            try:
                step = yield from self._gather(spec, poll, parts)
            except BufferError:
                yield from self._give_back(parts)
                raise
            if isinstance(step, GiveUp):
                if step.error is not None:
                    raise step.error
                return
            delivered, lost = yield from self._deliver(parts)
            sent += 1
            yield Emit(self._merge(delivered, spec, step.partial or lost, leases, kind))
            if step.partial:
                return

    def _gather(self, spec: SampleSpec, poll: Poll, parts: Parts) -> Plan[Done | GiveUp]:
        """One batch's parts, taken into `parts` as `poll` asks, until it has them all (Done) or
        gives up. A part the poll would hold past the last moment its shard takes its
        confirmation (`Held.due`: its max_confirm_seconds, which a sample's timeout may far
        outlast), through a pause or to the delivery, goes back to its buffer uncounted first
        and is asked for again: left held, its shard would give it back, and the batch would go
        out short of it. The pauses while parts are held are cut to fit them (`_within`), so a
        part waits, held, for the other shards' parts to come in later rounds."""
        step = poll.look((yield from self._ready(spec.table, poll.key)), time.monotonic())
        while True:
            if isinstance(step, Ask):
                fetched, refused = yield from self._fetch(spec, step.parts, step.late, poll.left(time.monotonic()))
                parts += fetched
                if refused:
                    raise shard_error(refused, self.shard_map.targets)
                step = poll.took((self._size(spec, held.batch) for _, held in fetched), time.monotonic())
            elif isinstance(step, GiveUp):
                return step
            elif overdue := self._overdue(parts, step):
                parts[:] = [part for part in parts if part not in overdue]
                yield from self._give_back(overdue)
                step = poll.returned((self._size(spec, held.batch) for _, held in overdue), time.monotonic())
            elif isinstance(step, Wait):
                yield self._within(parts, step)
                step = poll.look((yield from self._ready(spec.table, poll.key)), time.monotonic())
            else:
                return step

    @staticmethod
    def _overdue(parts: Parts, step: Wait | Done) -> Parts:
        """The parts in hand that cannot wait for the next step: before delivery, those past their
        due; before a pause, those with less than two of the shortest pauses left (`_within`)."""
        now = time.monotonic()
        room = 2 * POLL_SECONDS[0] if isinstance(step, Wait) else 0.0
        return [part for part in parts if part[1].due <= now + room]

    @staticmethod
    def _within(parts: Parts, step: Wait) -> Wait:
        """The poll's pause, cut to half of what the part in hand soonest due has left: the other
        half is for the next round's look, fetch and confirmation. A pause as long as the poll's
        would give back, at every pause, a part whose shard's max_confirm_seconds is shorter, and
        the batch would then come whole only where every shard's part came in one round."""
        left = min((held.due for _, held in parts), default=math.inf) - time.monotonic()
        return Wait(min(step.seconds, left / 2))

    def _ready(self, table: str, key: str) -> Plan[dict[str, int]]:
        """Each answering shard's ready count (a probe each: shards that do not answer, or refuse
        while others hold the table, are left out). Where no shard holds it and some refuse (the
        table missing there), the sample fails naming them, as one server's refusal does, rather
        than waiting out the timeout as if they were down."""
        calls = [Call(shard, "stats", (table,), quick=True) for shard in self.clients]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        counts = {shard: getattr(stats[table], key) for shard, stats in results.items() if table in stats}
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        if refused and not counts:
            raise shard_error(refused, self.shard_map.targets)
        return counts

    def _fetch(
        self, spec: SampleSpec, want: Mapping[str, int], late: bool, within: float
    ) -> Plan[tuple[Parts, dict[str, BufferError]]]:
        """One batch of each shard's part, in parallel, each held (`_hold`, for at most `within`,
        the time the batch is gathered for), and the shards that refused theirs; a shard that
        cannot give its part now gives nothing (taken by another trainer meanwhile, filtered out,
        or the shard went down)."""
        calls = [Call(shard, "_hold", (spec.part(count, late), within)) for shard, count in want.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        return [(shard, held) for shard, held in results.items() if held is not None], refused

    def _give_back(self, parts: Parts) -> Plan[None]:
        """The held parts of a batch that will not be handed over, back to their shards' buffers
        uncounted (their streams end unconfirmed)."""
        calls = [Call(shard, "give_back", on=held) for shard, held in parts]
        if calls:
            yield from self._direct(calls)

    def _deliver(self, parts: Parts) -> Plan[tuple[list[tuple[str, Batch]], bool]]:
        """A batch's held parts, confirmed on their shards, as their streams asked: the parts
        delivered, and whether any was left out. A part whose delivery failed (its shard ended
        its stream first, past its max_confirm_seconds, or went away) is not handed over, so none
        is delivered twice: one not delivered returns to its buffer uncounted. Raises ShardError
        when no part was delivered."""
        calls = [Call(shard, "deliver", on=held) for shard, held in parts]
        kept, failed = [], {}
        for call, outcome in zip(calls, (yield from self._direct(calls)), strict=True):
            if isinstance(outcome, BufferError):
                _log.warning("shard %s did not deliver its part of a batch, left out of it: %s", call.shard, outcome)
                failed[call.shard] = outcome
            else:
                kept.append((call.shard, outcome))
        if not kept:
            raise shard_error(failed, self.shard_map.targets)
        return kept, bool(failed)
