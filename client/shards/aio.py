"""AsyncShardedBufferClient: the asyncio twin of ShardedBufferClient (blocking.py).

It runs the same plans (plans.py; a declared call's route, rpc/declare.py), making the calls
each step asks for at once with asyncio.gather.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeGuard, Unpack

from ..aio import AsyncBufferClient, AsyncHeldBatch
from ..errors import BufferError
from ..results import AsyncBatch
from ..rpc import calls
from ..rpc.api import ShardCalls
from ..rpc.declare import AwaitingShards, Turns
from ..rpc.sample_spec import SampleOptions, SampleSpec
from .common import AsyncShardBatch, ShardBatch, closed_error
from .poll import Wait
from .pusher import AsyncShardedPusher
from .routes import ShardPlans
from .steps import Call, Emit, Plan, T


class AsyncShardedBufferClient(ShardPlans, AwaitingShards, ShardCalls):
    """asyncio twin of ShardedBufferClient, with the methods of AsyncBufferClient."""

    _client_class = AsyncBufferClient
    closed = False  # its close() began

    async def close(self) -> None:
        """Close every shard's channel; a call made after is refused CANCELLED."""
        self.closed = True
        clients = (*self.clients.values(), *self._probes.values(), *self._retired)
        await asyncio.gather(*(client.close() for client in clients))

    async def __aenter__(self) -> AsyncShardedBufferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- the driver --------------------------------------------------------------------------

    async def _call(self, call: Call) -> Any:
        client = call.on or (self._probes if call.quick else self.clients)[call.shard]
        try:
            return await getattr(client, call.method)(*call.args, **call.kwargs)
        except BufferError as exc:
            return exc

    async def _step(self, step: Any) -> Any:
        if self.closed:
            raise closed_error()
        if isinstance(step, Wait):
            await asyncio.sleep(step.seconds)
            return None
        made = [asyncio.ensure_future(self._call(call)) for call in step]
        try:
            return await asyncio.gather(*made)
        except asyncio.CancelledError:  # the parts its calls took by then go back (the others' calls end)
            taken = [task.result() for task in made if task.done() and not task.cancelled()]
            await asyncio.shield(_given_back([part for part in taken if isinstance(part, AsyncHeldBatch)]))
            raise

    async def _run(self, plan: Plan[T]) -> T:
        turns = Turns(plan)
        for step in turns:
            turns.answer(await self._step(step))
        return turns.result

    # ---- its own calls (the others are declared once: rpc/api.py) -----------------------------

    def pusher(self, table: str = "default", *, window: int = 4, timeout: float | None = None) -> AsyncShardedPusher:
        """Pipelined pushes to `table` over the shards, as ShardedBufferClient.pusher: `await
        pusher.push(items)` returns an asyncio Future of the PushResult. See AsyncShardedPusher."""
        return AsyncShardedPusher(self, table, window, timeout, lambda: self._run(self._group_by_of(table)))

    async def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        **options: Unpack[SampleOptions],
    ) -> AsyncIterator[ShardBatch]:
        """As ShardedBufferClient.sample; leased batches' ack()/nack() return coroutines."""
        spec = SampleSpec(table, batch_size, num_groups, **options)
        held: list[AsyncHeldBatch] = []  # parts taken and neither delivered nor given back yet
        held_back = calls.HeldBack()  # a cancel the batch's delivery held back (_delivered)
        try:
            for step in (turns := Turns(self._sample(spec, self, AsyncShardBatch))):
                if isinstance(step, Emit):
                    yield step.batch
                    held_back.raise_now()
                    continue
                if _delivers(step):
                    answers = await self._delivered(step, spec, held_back)
                else:
                    answers = await self._step(step)
                _follow(held, step, answers)
                turns.answer(answers)
        except (asyncio.CancelledError, GeneratorExit):  # a caller that left mid-batch: its parts go back
            await asyncio.shield(_given_back(held))
            raise
        finally:
            held_back.pass_on()  # the caller left before its next step (a break, aclose)

    async def _delivered(self, step: list[Call], spec: SampleSpec, held_back: calls.HeldBack) -> list[Any]:
        """A step that confirms a batch's held parts, run to its end whatever cancels the caller
        meanwhile: once a confirmation goes, its shard consumes the part, starts its lease or counts
        its replay, and a cancel that cut the step lost a consumed batch (the caller had no batch,
        the shards none). A consumed batch, which nothing can put back, is handed over: the
        cancelled await returns it, the cancel held back (`held_back` says so) to the caller's next
        step. The others' parts go back (a leased part's nack; a replayed part stays, its replay
        counted) and the cancel goes on."""
        confirming, before = asyncio.ensure_future(self._step(step)), calls.HeldBack.begin()
        try:
            return await asyncio.shield(confirming)
        except asyncio.CancelledError:
            answers = await calls.finished(confirming)
            if spec.delivery == "consume":
                held_back.hold(before)
                return answers
            await asyncio.shield(_handed_back(answers))
            raise


def _follow(held: list[AsyncHeldBatch], step: Any, answers: Any) -> None:
    """Keep `held` to the parts a sample's plan holds: those its step took (`_hold`), less those it
    delivered or gave back."""
    if isinstance(step, Wait):
        return
    for call, answer in zip(step, answers, strict=True):
        if call.method == "_hold" and isinstance(answer, AsyncHeldBatch):
            held.append(answer)
        elif call.method in ("deliver", "give_back") and call.on in held:
            held.remove(call.on)


def _delivers(step: Any) -> TypeGuard[list[Call]]:
    """Whether a step of a sample's plan confirms a batch's held parts."""
    return isinstance(step, list) and any(call.method == "deliver" for call in step)


async def _handed_back(answers: list[Any]) -> None:
    """The parts a confirmation step delivered (its answers: a part, or its shard's error), back
    to their buffers: a leased part's lease ended (nack); nothing to do for the others."""
    parts = [answer for answer in answers if isinstance(answer, AsyncBatch)]
    await asyncio.gather(*(part.nack() for part in parts), return_exceptions=True)


async def _given_back(parts: list[AsyncHeldBatch]) -> None:
    """Parts of a batch no caller will have, back to their shards' buffers uncounted."""
    await asyncio.gather(*(part.give_back() for part in parts), return_exceptions=True)
