"""What a sharded client's plan yields and is sent (plans.py says how a plan runs): the shard
calls to make in parallel (a list of `Call`), a pause (`poll.Wait`) or, while sampling, a batch for
the caller (`Emit`); and which outcomes say a shard is down rather than refusing."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from ..errors import BufferError
from .common import ShardBatch
from .poll import Wait

T = TypeVar("T")

# The codes of a shard that is down or cut off, rather than one that refused the call.
DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class Call:
    """One call of a shard's client: `method(*args, **kwargs)`, or of `on` where set (a part of a
    sample the shard's client holds for the batch: sampling.py).

    `quick` asks with the shard's probe client (one attempt, a short deadline); None does so
    only while the shard is believed down, for the small calls that may degrade.
    """

    shard: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    quick: bool | None = False
    on: Any = None


@dataclass(frozen=True)
class Emit:
    batch: ShardBatch


Step = list[Call] | Wait | Emit
Plan = Generator[Step, Any, T]


def is_down(outcome: Any) -> bool:
    return isinstance(outcome, BufferError) and outcome.code in DOWN_CODES


def shows_down(call: Call, outcome: Any) -> bool | None:
    """Whether `call`'s outcome shows its shard down (True: UNAVAILABLE, or the client's deadline
    passed with no answer), up (False: an answer, even a refusal), or neither (None: a deadline its
    caller chose, push's `timeout`, passed with no answer; the shard had only the time it was given).
    A DEADLINE_EXCEEDED the shard sent is its answer, with its reason (its wait for data ran out,
    not_ready; a part held past its max_confirm_seconds, unconfirmed), and so is a held part's
    (`on`) that the client found too late to confirm: the shard handed it over."""
    if not is_down(outcome):
        return False
    if outcome.code == grpc.StatusCode.UNAVAILABLE:
        return True
    if outcome.reason is not None or call.on is not None:
        return False
    return None if call.kwargs.get("timeout") is not None else True
