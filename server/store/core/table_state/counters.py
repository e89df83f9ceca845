"""A table's durable counters: counts by state, bytes and totals, written in the same
transaction as the records they count.

`Counters` is a slotted type: a misspelt counter is an AttributeError where it is written, and
no counter comes into being by accident. Its stored form is a flat JSON object of the fields
by name (the form every release wrote): a stored object lacking a field (one an older release
did not keep) reads as that field's zero, and one holding a field this release does not know
(a newer release's) keeps it as it was, to write it back unchanged.
"""

from __future__ import annotations

import builtins
import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from json.encoder import encode_basestring_ascii
from typing import Any

import lmdb

from ...disk.batch_rows import Reader
from ...schema.states import COMPUTING, CONSUMED, DROPPED, EVICTED, FAILED, LEASED, PENDING, QUARANTINED, READY, State

# The counters of what reward shaping and advantage clipping did (see advantages/shaping.py).
SHAPING_COUNTERS = ("overlong_penalised", "rewards_seen", "rewards_clipped", "advantages_seen", "advantages_clipped")


@dataclass(slots=True)
class Counters:
    """One table's counters."""

    # experiences by state (the live ones, then the tombstones) and the live ones' bytes
    pending: int = 0
    computing: int = 0
    ready: int = 0
    leased: int = 0
    consumed: int = 0
    evicted: int = 0
    dropped: int = 0
    failed: int = 0
    quarantined: int = 0  # found damaged when read or scrubbed (quarantine.py): never served
    bytes: int = 0
    # groups by live state, and those dropped and failed
    groups_pending: int = 0
    groups_computing: int = 0
    groups_ready: int = 0
    groups_leased: int = 0
    groups_dropped: int = 0
    groups_failed: int = 0
    pushed: int = 0
    duplicates: int = 0
    sampled: int = 0
    leases_expired: int = 0
    damaged: int = 0  # experiences ever quarantined (their tombstones are forgotten in time, this total is not),
    # the members of pending or computing groups removed whole for a damaged head (rows/deletes.remove_damaged),
    # and rollouts held in pieces dropped for a piece lost or damaged (partial_holds.drop_damaged)
    # monotonic totals for the metrics
    bytes_pushed: int = 0
    bytes_sampled: int = 0
    evicted_total: int = 0
    dropped_zero_variance: int = 0
    dropped_timeout: int = 0
    dropped_std_threshold: int = 0
    dropped_stale: int = 0
    dropped_short: int = 0  # too few of the group's runs succeeded (min_group_size)
    dropped_claim_ended: int = 0  # its prompt's claim ended first (the prompt ledger)
    runs_failed: int = 0  # runs their workers reported failed (FailRuns)
    groups_short: int = 0  # groups that completed with fewer members than group_size
    groups_timed_out: int = 0  # groups their timeout ended (released, dropped, dropped short): runs that never came
    tokens_masked: int = 0  # delivered tokens masked out of the action mask as too stale (max_token_staleness)
    partials: int = 0  # rollouts held in pieces, not finished yet (partials.py)
    partial_bytes: int = 0  # the bytes of their pieces, counted against capacity_bytes (capacity.py)
    pieces_pushed: int = 0  # pieces of partial rollouts stored
    values: int = 0  # keyed values the table holds (value_records.py)
    value_bytes: int = 0  # their bytes, each key's and value's, counted against capacity_bytes (capacity.py)
    # what reward shaping and advantage clipping did (SHAPING_COUNTERS)
    overlong_penalised: int = 0
    rewards_seen: int = 0
    rewards_clipped: int = 0
    advantages_seen: int = 0
    advantages_clipped: int = 0
    # off-policy control (admission.py)
    submitted: int = 0
    admitted: int = 0
    grants_expired: int = 0
    rollouts_rejected: int = 0
    stale_dropped: int = 0
    # seconds the rate limits held inserts and samples, and the limiter's own counts (rate_counts.py)
    insert_blocked_seconds: float = 0
    sample_blocked_seconds: float = 0
    rate_inserted: float = 0
    rate_sampled: float = 0
    # the next insertion and ready sequence numbers
    next_seq: int = 0
    next_rseq: int = 0
    min_version: int | None = None
    trainer_version: int | None = None  # the trainer's policy version (set_trainer_version)
    max_version: int | None = None
    last_failure: str = ""
    reward_moments: list[float] | None = None  # [mean, population variance, count] of the running reward normalisation
    # what a newer release stored that this one does not know, written back as it was
    unknown: dict[str, Any] = field(default_factory=dict)

    def in_state(self, state: State) -> int:
        """Experiences in `state`."""
        count: int = getattr(self, _BY_STATE[state])
        return count

    def add(self, state: State, count: int) -> None:
        """`count` more experiences in `state` (fewer when negative)."""
        name = _BY_STATE[state]
        setattr(self, name, getattr(self, name) + count)

    def add_groups(self, state: State, count: int) -> None:
        """`count` more groups in live `state` (fewer when negative)."""
        name = _GROUPS_BY_STATE[state]
        setattr(self, name, getattr(self, name) + count)

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add to counts by name (what reward shaping did, by SHAPING_COUNTERS); a name that
        is no count is a KeyError, never a new counter."""
        for name, count in counts.items():
            if name not in _COUNTS:
                raise KeyError(f"no counter {name!r}")
            setattr(self, name, getattr(self, name) + count)

    def live(self) -> int:
        """Live experiences (pending, computing, ready, leased)."""
        return self.pending + self.computing + self.ready + self.leased

    # ---- the stored form -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every counter this release knows, by name."""
        return dict(zip(NAMES, _values(self), strict=True))

    def encode(self) -> builtins.bytes:  # `bytes` in this class is the counter
        """The stored form: the known counters, then the unknown ones as they were read. Remembered
        (`_Decoded`), since the next transaction reads back what this one wrote."""
        values = _values(self)
        if self.unknown:
            raw = _ENCODER.encode(dict(zip(NAMES, values, strict=True)) | self.unknown).encode()
        else:
            raw = _FORMS.encode(values)
        _DECODED.keep(raw, values, self.unknown)
        return raw

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> Counters:
        """Counters from their stored form; a count that is not a number is a ValueError."""
        if not isinstance(stored, dict):
            raise ValueError(f"the counters are a {type(stored).__name__}, not an object")
        for name in _COUNTS.intersection(stored):
            value = stored[name]
            if type(value) not in _NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"counter {name} is {value!r}, not a number")
        unknown = {name: value for name, value in stored.items() if name not in _FIELDS}
        return cls(*[*(stored.get(name, default) for name, default in _DEFAULTS), unknown])

    @classmethod
    def decode(cls, raw: builtins.bytes | memoryview | None) -> Counters:
        if raw is None:
            return cls()
        raw = bytes(raw)
        found = _DECODED.get(raw)
        if found is None:
            counters = cls.from_dict(json.loads(raw))
            _DECODED.keep(raw, _values(counters), counters.unknown)
            return counters
        values, unknown = found
        counters = cls(*[*values, dict(unknown)])
        if counters.reward_moments is not None:  # the one counter a list: the caller's own
            counters.reward_moments = list(counters.reward_moments)
        return counters


class _Decoded:
    """The counters of the stored forms last written or read, by the stored bytes: a table's
    every transaction reads its counters and writes them back, and a transaction mostly reads
    what the one before wrote. Keyed by the bytes themselves, an entry can never be stale; it
    holds values only (tuples; a list counter as a tuple) and copies of the unknown ones."""

    LIMIT = 256  # stored forms remembered: a table's last few, for many tables

    def __init__(self) -> None:
        self._found: dict[bytes, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def get(self, raw: bytes) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        return self._found.get(raw)

    def keep(self, raw: bytes, values: tuple[Any, ...], unknown: dict[str, Any]) -> None:
        if len(self._found) >= self.LIMIT:
            self._found.clear()
        moments = values[_MOMENTS]
        if moments is not None:
            values = (*values[:_MOMENTS], tuple(moments), *values[_MOMENTS + 1 :])
        self._found[raw] = (values, dict(unknown))


class _Forms:
    """The stored form of known counters alone (no unknown one), byte for byte the JSON object the
    encoder writes, made by one `%` over a template of the counters' names for the types their
    values have: a table's every transaction writes its counters, and the encoder's walk over a
    dict of some 60 names (each name escaped, each value looked at) cost far more than the
    numbers' text. An int is written by `%d` (its JSON text), any other value as `_text` says."""

    LIMIT = 64  # templates remembered: a value's type changes rarely (None to an int, an int to a float)

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names
        self._plans: dict[tuple[type, ...], tuple[str, tuple[int, ...]]] = {}

    def encode(self, values: tuple[Any, ...]) -> builtins.bytes:
        shape = tuple(map(type, values))
        plan = self._plans.get(shape)
        if plan is None:
            if len(self._plans) >= self.LIMIT:
                self._plans.clear()
            plan = self._plans[shape] = self._plan(shape)
        template, others = plan
        if not others:
            return (template % values).encode()
        args = list(values)
        for at in others:
            args[at] = _text(args[at])
        return (template % tuple(args)).encode()

    def _plan(self, shape: tuple[type, ...]) -> tuple[str, tuple[int, ...]]:
        """The template for values of these types, and where its values are written by `_text`."""
        others = tuple(at for at, kind in enumerate(shape) if kind is not int)
        fields = [
            encode_basestring_ascii(name).replace("%", "%%") + (":%d" if kind is int else ":%s")
            for name, kind in zip(self._names, shape, strict=True)
        ]
        return "{" + ",".join(fields) + "}", others


def _text(value: Any) -> str:
    """A counter's JSON text, as the encoder writes it: a float, None and a str without the
    encoder's setup for each (most of its cost for one value), anything else by the encoder."""
    kind = type(value)
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else _SPECIAL[str(value)]
    if value is None:
        return "null"
    if kind is str:
        return encode_basestring_ascii(value)
    return _ENCODER.encode(value)


_SPECIAL = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # the encoder's (allow_nan)
NAMES = tuple(f.name for f in fields(Counters) if f.name != "unknown")
_FIELDS = frozenset(NAMES)
_COUNTS = frozenset(f.name for f in fields(Counters) if f.default == 0 and f.name in _FIELDS)
_DEFAULTS = tuple((f.name, f.default) for f in fields(Counters) if f.name in _FIELDS)
_NUMBERS = (int, float)
_MOMENTS = NAMES.index("reward_moments")
_values = operator.attrgetter(*NAMES)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_FORMS = _Forms(NAMES)
_DECODED = _Decoded()
# The counter of the experiences in each state, and of the groups in each live state.
_BY_STATE = {PENDING: "pending", COMPUTING: "computing", READY: "ready", LEASED: "leased"} | {
    CONSUMED: "consumed",
    EVICTED: "evicted",
    DROPPED: "dropped",
    FAILED: "failed",
    QUARANTINED: "quarantined",
}
_GROUPS_BY_STATE = {
    PENDING: "groups_pending",
    COMPUTING: "groups_computing",
    READY: "groups_ready",
    LEASED: "groups_leased",
}


def read_counters(txn: Reader, dbs: Mapping[str, lmdb._Database], prefix: bytes) -> Counters:
    """A table's stored counters (zero for a table that has none yet), from a transaction or a
    snapshot over the store's databases."""
    return Counters.decode(txn.get(prefix, db=dbs["counters"]))


def write_counters(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, c: Counters) -> None:
    """A table's counters stored."""
    txn.put(prefix, c.encode(), db=dbs["counters"])


def stored_names(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes
) -> frozenset[str] | None:
    """The counters a table's stored form holds (None: nothing stored): which release wrote it."""
    raw = txn.get(prefix, db=dbs["counters"])
    return None if raw is None else frozenset(json.loads(bytes(raw)))
