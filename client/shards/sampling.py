"""The sharded clients' sample: batches drawn from every shard in proportion to what each holds
ready (poll.Poll), a shard's refusal failing the sample with the other shards' parts given back.
A plan, as plans.py's: the blocking and the asyncio client run it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from ..errors import BufferError
from ..results import Batch, Leases
from ..rpc.sample_spec import SampleSpec
from ..schema.call_limits import MAX_LEASE_SECONDS
from .common import ShardBatch, shard_error
from .plans import Planned
from .poll import Ask, GiveUp, Poll, Wait
from .steps import Call, Emit, Plan, is_down

_log = logging.getLogger("expbuf.client")


class SamplePlans(Planned):
    """The plan of a sample over shards."""

    def _sample(self, spec: SampleSpec, leases: Leases, kind: type[ShardBatch]) -> Plan[None]:
        """Batches drawn from every shard in proportion to what each holds ready, as Poll decides.

        A shard that refuses its part (its table's streams all taken, a part it cannot decode...)
        fails the sample at once with that refusal, as one server's would, and the parts the other
        shards handed over for the batch go back to their buffers (`_give_back`). So that a
        consumed part can go back too, each is taken leased and acknowledged once the whole batch
        is in hand (`_consume`): the shard consumes it as a consume's confirmation would."""
        if spec.trainer_version is not None:  # every shard, the admission shard too
            yield from self._set_trainer_version(spec.trainer_version, spec.table, need_answer=False)
        take = spec
        if spec.delivery == "consume":  # its lease lasts out the wait for the rest of the batch
            seconds = min(spec.lease_seconds + spec.timeout, MAX_LEASE_SECONDS)
            take = replace(spec, delivery="lease", lease_seconds=seconds)
        sent = 0
        while not spec.max_batches or sent < spec.max_batches:
            poll, parts = Poll(spec, self.clients, time.monotonic()), []
            step = poll.look((yield from self._ready(spec.table, poll.key)), time.monotonic())
            while isinstance(step, (Ask, Wait)):
                if isinstance(step, Ask):
                    fetched, refused = yield from self._fetch(take, step.parts, step.late)
                    parts += fetched
                    if refused:
                        yield from self._give_back(parts, spec.table)
                        raise shard_error(refused, self.shard_map.targets)
                    step = poll.took((self._size(spec, batch) for _, batch in fetched), time.monotonic())
                else:
                    yield step
                    step = poll.look((yield from self._ready(spec.table, poll.key)), time.monotonic())
            if isinstance(step, GiveUp):
                if step.error is not None:
                    raise step.error
                return
            partial = step.partial
            if take is not spec:
                parts, lost = yield from self._consume(parts, spec.table)
                partial = partial or lost
            sent += 1
            yield Emit(self._merge(parts, spec, partial, leases, kind))
            if step.partial:
                return

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
        self, spec: SampleSpec, want: Mapping[str, int], late: bool
    ) -> Plan[tuple[list[tuple[str, Batch]], dict[str, BufferError]]]:
        """One batch of each shard's part, in parallel, and the shards that refused theirs; a shard
        that cannot give its part now gives nothing (taken by another trainer meanwhile, filtered
        out, or the shard went down)."""
        calls = [Call(shard, "sample", (), spec.part(count, late).keywords()) for shard, count in want.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        return [(shard, batch) for shard, batches in results.items() for batch in batches], refused

    def _give_back(self, parts: list[tuple[str, Batch]], table: str) -> Plan[None]:
        """The leased parts of a batch that will not be handed over, back to their shards' buffers
        (a replayed part stayed there); one a shard does not take back now returns as its lease ends."""
        calls = [Call(shard, "nack", (batch.lease_id, table)) for shard, batch in parts if batch.lease_id]
        for call, outcome in zip(calls, (yield from self._exchange(calls)) if calls else [], strict=True):
            if isinstance(outcome, BufferError):
                _log.warning("shard %s did not take back its part of a batch not handed over: %s", call.shard, outcome)

    def _consume(self, parts: list[tuple[str, Batch]], table: str) -> Plan[tuple[list[tuple[str, Batch]], bool]]:
        """A consumed batch's parts, taken leased, acknowledged on their shards: the parts that
        were, as consumed parts (no lease), and whether any was left out. A part whose ack failed
        is not handed over, so none is delivered twice: it returns to its buffer as its lease
        ends. Raises ShardError when no part was acknowledged."""
        calls = [Call(shard, "ack", (batch.lease_id, table)) for shard, batch in parts]
        outcomes = yield from self._exchange(calls)
        kept, failed = [], {}
        for (shard, batch), outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BufferError):
                failed[shard] = outcome
            else:
                batch.lease_id, batch.lease_expires = "", 0.0
                kept.append((shard, batch))
        if not kept:
            raise shard_error(failed, self.shard_map.targets)
        return kept, bool(failed)
