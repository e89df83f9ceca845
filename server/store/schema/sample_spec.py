"""What a sample request asks for, checked once where it enters the server.

The service builds a TakeSpec from the wire, tests and tools build one directly,
and the store reads it: one definition of the parameters and their ranges instead of
the same nine arguments in every layer.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from expbuf.client.schema.call_limits import MAX_LEASE_SECONDS, MAX_WINDOW
from expbuf.client.trxp.stored.columns import unknown_field

from . import order_names
from .errors import SpecError, clip

DELIVERIES = ("consume", "lease", "replay")
MAX_WAIT_SECONDS = float(2**31)  # a request's wait; the server bounds it further (max_wait_seconds)
# Counts travel as uint32; anything at or above 2**31 is a negative number sent unsigned.
MAX_COUNT = 2**31 - 1
INT64 = (-(2**63), 2**63 - 1)
# The most experiences a batch holds: its take holds the store's one writer, every other tenant's
# pushes waiting, some 10-35 µs an experience (a take of 300,000 held it 10 s); take several.
MAX_BATCH = 65_536
# A columnar request's fields: how many it may name, and how long a name may be (in UTF-8 bytes).
MAX_FIELDS = 64
MAX_FIELD_NAME = 128


def check_count(name: str, value: int) -> None:
    """Refuse counts that are not integers in 0..2**31-1 (a uint32 negative arrives as 2**32-1)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SpecError(f"{name} must be a non-negative integer, got {value!r}")
    if value > MAX_COUNT:
        raise SpecError(f"{name} is {value}, above {MAX_COUNT} (a negative number sent as an unsigned integer?)")


def check_version(name: str, value: object) -> int:
    """A policy version: a non-negative 64-bit integer."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64[1]:
        raise SpecError(f"{name} must be an integer in 0..{INT64[1]}, got {clip(repr(value))}")
    return value


def check_seconds(name: str, value: float, *, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SpecError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise SpecError(f"{name} is {value:g}; it must be {bound} and <= {high:g}")


def check_fields(fields: tuple[str, ...]) -> None:
    """The fields of a columnar request: at most MAX_FIELDS names, each a non-empty string of at
    most MAX_FIELD_NAME bytes, none twice, each a field a column could be (trxp.stored.columns.FIELDS)."""
    if len(fields) > MAX_FIELDS:
        raise SpecError(f"fields names {len(fields)} fields; at most {MAX_FIELDS}")
    for name in fields:
        if not isinstance(name, str) or not name or len(name.encode()) > MAX_FIELD_NAME:
            raise SpecError(f"fields: {clip(repr(name))} is not a field name (1 to {MAX_FIELD_NAME} bytes)")
    if len(set(fields)) != len(fields):
        twice = sorted({name for name in fields if fields.count(name) > 1})
        raise SpecError(f"fields names {clip(', '.join(twice))} more than once")
    unknown = unknown_field(fields)
    if unknown is not None:
        raise SpecError(f"fields: {unknown}")


@dataclass(frozen=True)
class TakeSpec:
    """One stream's request: how many, in which order, delivered how, and how long to wait.

    Exactly one of `num_groups` (whole groups) or `batch_size` (experiences, filled with
    whole groups) is set. `wait_seconds` is how long each batch may wait for enough
    data; `max_batches` 0 streams until cancelled.
    """

    table: str = "default"
    num_groups: int = 0
    batch_size: int = 0
    order: str = "fifo"
    delivery: str = "consume"
    lease_seconds: float = 60.0
    wait_seconds: float = 0.0
    allow_partial: bool = False
    max_batches: int = 0
    min_model_version: int | None = None
    trainer_version: int | None = None  # stored for the table before the batch is taken
    window: int = 1  # batches sent ahead of the client's confirmations (1..MAX_WINDOW)
    compact_advantages: bool = False  # one value per experience beside the payload, where it can be
    fields: tuple[str, ...] = ()  # a columnar reply of these tensor fields; empty: the TRXP payload

    def __post_init__(self) -> None:
        for name in ("num_groups", "batch_size", "max_batches"):
            check_count(name, getattr(self, name))
        if (self.num_groups > 0) == (self.batch_size > 0):
            raise SpecError("set exactly one of num_groups or batch_size (> 0)")
        if max(self.num_groups, self.batch_size) > MAX_BATCH:
            asked = "num_groups" if self.num_groups else "batch_size"
            raise SpecError(
                f"{asked} is {max(self.num_groups, self.batch_size)}: a batch holds at most {MAX_BATCH} experiences "
                "(its take holds the store's writer); take several batches"
            )
        if self.order not in order_names.NAMES:
            raise SpecError(f"order is {self.order[:70]!r}; expected one of {', '.join(order_names.NAMES)}")
        if self.delivery not in DELIVERIES:
            raise SpecError(f"delivery is {self.delivery!r}; expected one of {', '.join(DELIVERIES)}")
        if self.delivery == "lease":
            check_seconds("lease_seconds", self.lease_seconds, low=0.0, high=MAX_LEASE_SECONDS, low_open=True)
        check_seconds("wait_seconds", self.wait_seconds, low=0.0, high=MAX_WAIT_SECONDS)
        version = self.min_model_version
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or not INT64[0] <= version <= INT64[1]
        ):
            raise SpecError(f"min_model_version must be a 64-bit integer, got {version!r}")
        if self.trainer_version is not None:
            check_version("trainer_version", self.trainer_version)
        if not isinstance(self.window, int) or isinstance(self.window, bool) or not 1 <= self.window <= MAX_WINDOW:
            raise SpecError(f"window is {self.window!r}; it must be 1 to {MAX_WINDOW} batches ahead")
        check_fields(self.fields)

    def enough(self, groups: int, experiences: int) -> bool:
        """Whether `groups` groups holding `experiences` experiences make the batch asked for."""
        if self.num_groups:
            return groups >= self.num_groups
        return experiences >= self.batch_size

    def filled(self, groups: int, experiences: int) -> bool:
        """Whether the groups a take chose so far make the batch asked for; past MAX_BATCH
        experiences before that (groups of many), the request is refused."""
        if self.enough(groups, experiences):
            return True
        if experiences > MAX_BATCH:
            raise SpecError(
                f"the first {groups} of the {self.num_groups} groups asked for hold {experiences} experiences: a "
                f"batch holds at most {MAX_BATCH} (its take holds the store's writer); ask for fewer groups a batch"
            )
        return False

    def taking(self, groups: int, experiences: int, counts: Sequence[int]) -> int:
        """How many of the next groups in order, of `counts` experiences each, the batch takes after
        `groups` holding `experiences`: up to the first that makes it enough, or all; a SpecError
        where `filled`, asked after each group in turn, would raise."""
        totals = list(itertools.accumulate(counts, initial=experiences))[1:]  # after each group
        if self.num_groups:
            chosen = min(len(counts), self.num_groups - groups)
        else:
            chosen = min(len(counts), bisect.bisect_left(totals, self.batch_size) + 1)
        over = bisect.bisect_right(totals, MAX_BATCH)  # the first group after which it holds more
        if over < chosen:
            self.filled(groups + over + 1, totals[over])  # refused there unless it is enough
        return chosen

    @property
    def want(self) -> str:
        """The requested amount, in words, for messages."""
        if self.num_groups:
            return f"{self.num_groups} group{'s' if self.num_groups != 1 else ''}"
        return f"{self.batch_size} experience{'s' if self.batch_size != 1 else ''}"
