"""What a client's `sample()` asks for: one definition of its parameters, their defaults and their ranges.

Every client (blocking, asyncio, and both sharded ones) builds a SampleSpec from the
keywords it is called with, so a bad value is refused here, naming the parameter, before
any stream opens; the server checks the same ranges again where the request enters it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict

from expbuf.proto.v1 import buffer_pb2 as pb

from ..schema.call_limits import MAX_WINDOW
from ..schema.orders import order_problem
from ..trxp.stored.columns import unknown_field
from . import wire


class SampleOptions(TypedDict, total=False):
    """The keywords of `sample()` after table, batch_size and num_groups (see SampleSpec)."""

    order: str
    delivery: str
    lease_seconds: float
    timeout: float
    max_batches: int
    min_model_version: int | None
    allow_partial: bool
    trainer_version: int | None
    window: int
    prefetch: int
    fields: Sequence[str] | None


def _integer(name: str, value: Any, low: int, *, optional: bool = False, what: str = "") -> None:
    """Refuse `value` unless an integer >= `low` (or None, where `optional`), naming `name` and
    what it counts (`what`)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"sample: {name} is {value!r}; it must be an integer >= {low}{what}")


def _seconds(name: str, value: Any, *, positive: bool) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"sample: {name} is {value!r}; it must be a finite number of seconds")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"sample: {name} is {value!r}; it must be {'> 0' if positive else '>= 0'} seconds")


@dataclass(frozen=True)
class SampleSpec:
    """One sample stream's request, checked when built.

    Exactly one of `batch_size` (experiences, filled with whole groups) or `num_groups`
    (whole groups) is set. `delivery` is "lease" (the default: a batch comes back unless
    acked within `lease_seconds`, so a trainer that dies mid-step loses nothing), "consume"
    (at most once: it leaves the buffer once it has arrived) or "replay" (it stays).
    `timeout` is how long each batch may wait for enough ready data; `max_batches` 0 streams
    until the caller stops; `window` is how many batches the server keeps on their way (1 to
    MAX_WINDOW); `prefetch` is how many of those the client decodes ahead of its caller on a
    thread of the stream's own (0: none, each is decoded when the caller asks; at most
    `window`, since a batch decoded ahead is one the server sent ahead; see prefetch.py).
    """

    table: str = "default"
    batch_size: int | None = None
    num_groups: int | None = None
    order: str = "fifo"
    delivery: str = "lease"
    lease_seconds: float = 60.0
    timeout: float = 30.0
    max_batches: int = 0
    min_model_version: int | None = None
    allow_partial: bool = False
    trainer_version: int | None = None
    window: int = 2
    prefetch: int = 1
    fields: Sequence[str] | None = None

    def __post_init__(self) -> None:
        _integer(
            "batch_size", self.batch_size, 1, optional=True, what=" (experiences a batch, filled with whole groups)"
        )
        _integer("num_groups", self.num_groups, 1, optional=True, what=" (whole groups a batch)")
        if (self.batch_size is None) == (self.num_groups is None):
            raise ValueError("sample: pass exactly one of batch_size (experiences) or num_groups (whole groups)")
        if not isinstance(self.table, str):
            raise ValueError(f"sample: table is {self.table!r}; it must be a table's name")
        problem = order_problem(self.order)
        if problem is not None:
            raise ValueError(f"sample: {problem}")
        if self.delivery not in wire.DELIVERY:
            raise ValueError(f"sample: delivery is {self.delivery!r}; expected one of {', '.join(wire.DELIVERY)}")
        _seconds("lease_seconds", self.lease_seconds, positive=True)
        _seconds("timeout", self.timeout, positive=False)
        _integer("max_batches", self.max_batches, 0)
        _integer("min_model_version", self.min_model_version, -(2**63), optional=True)
        _integer("trainer_version", self.trainer_version, 0, optional=True)
        if not isinstance(self.allow_partial, bool):
            raise ValueError(f"sample: allow_partial is {self.allow_partial!r}; it must be True or False")
        _integer("window", self.window, 1)
        if self.window > MAX_WINDOW:
            raise ValueError(f"sample: window is {self.window}; it must be 1 to {MAX_WINDOW} batches ahead")
        _integer("prefetch", self.prefetch, 0)
        if self.fields is not None:
            if isinstance(self.fields, str) or not all(isinstance(name, str) and name for name in self.fields):
                raise ValueError(f"sample: fields is {self.fields!r}; it must be a list of tensor field names")
            if not self.fields:
                raise ValueError("sample: fields is empty; name the tensor fields to read, or leave it None")
            unknown = unknown_field(self.fields)
            if unknown is not None:
                raise ValueError(f"sample: fields: {unknown}")
            object.__setattr__(self, "fields", tuple(self.fields))
        if self.prefetch > self.window:
            raise ValueError(
                f"sample: prefetch is {self.prefetch}; it must be 0 to window ({self.window}): a batch decoded "
                "ahead is one of the batches the server sends ahead"
            )

    @property
    def size(self) -> int:
        """The requested amount: experiences (batch_size) or groups (num_groups)."""
        return self.num_groups or self.batch_size or 0

    @property
    def by_groups(self) -> bool:
        """Whether the amount counts whole groups (num_groups) rather than experiences."""
        return bool(self.num_groups)

    def keywords(self) -> dict[str, Any]:
        """The spec as the keywords of a client's `sample()`."""
        return asdict(self)

    @property
    def ahead(self) -> int:
        """How many batches the client decodes ahead of its caller: `prefetch`, but none for a
        stream of one batch, which has nothing after it to decode."""
        return 0 if self.max_batches == 1 else self.prefetch

    def part(self, size: int, allow_partial: bool) -> SampleSpec:
        """One batch of `size` of the same unit at once, as a sharded client asks of one shard."""
        one = replace(self, timeout=0.0, max_batches=1, allow_partial=allow_partial)
        return replace(one, num_groups=size) if self.by_groups else replace(one, batch_size=size)

    def request(self, max_reply_bytes: int, *, answers_stopping: bool = False) -> pb.SampleRequest:
        """The first message of the Sample stream, for a client that receives messages of up to
        `max_reply_bytes` (a larger batch comes in parts) and, with `answers_stopping`, answers
        a server's word that it is stopping (calls.Handing; a held batch's stream does not: it
        delivers its batch only once the stream has ended). Such a stream that consumes awaits
        each batch's delivery before it hands it over (calls.Deliveries): at most once."""
        return pb.SampleRequest(
            table=self.table,
            batch_size=self.batch_size or 0,
            num_groups=self.num_groups or 0,
            **wire.order_fields(self.order),
            delivery=wire.DELIVERY[self.delivery],
            lease_seconds=self.lease_seconds,
            wait_seconds=self.timeout,
            allow_partial=self.allow_partial,
            max_batches=self.max_batches,
            min_model_version=self.min_model_version or 0,
            has_min_model_version=self.min_model_version is not None,
            trainer_version=self.trainer_version or 0,
            has_trainer_version=self.trainer_version is not None,
            window=self.window,
            compact_advantages=True,
            fields=self.fields or (),
            max_reply_bytes=max_reply_bytes,
            answers_stopping=answers_stopping,
            awaits_delivery=answers_stopping and self.delivery == "consume",
        )
