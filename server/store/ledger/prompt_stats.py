"""Per-prompt statistics: how each prompt of a dataset fared over its epochs, updated in the
transaction of the event that changes them (a claim, its group generated, its group trained), so
a restart or a kill -9 loses none. Stored under T + "s" + name + 0 + index (records.py lists the
ledger's keys); the dataset record counts its prompts by the band of their pass rate, so a scrape
reads no prompt. A curriculum reads them."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

import lmdb

from expbuf.client.schema.prompts import PromptStats as Stats

from ..core.table_state.state import TableState
from ..disk import layout
from ..disk.layout import U64
from ..rules.pushed_advantages import zero_variance
from .records import DatasetRecord

_STATS = struct.Struct("<IIQQIddIqq")
_TAIL = struct.Struct("<I")  # skip_until: a record written before it has none
# A prompt's pass rate in bands: never passed, passed less than half its runs, half or more but
# not all, every one (zero and all: the prompts whose groups have no variance to learn from).
PASS_BANDS = ("zero", "low", "high", "all")


@dataclass
class KeptStats(Stats):
    """A prompt's statistics as the ledger keeps them: the client's type, with its encoding and
    the first epoch it is handed out again after its zero-variance group (`zero_variance = "skip"`)."""

    skip_until: int = 0

    def encode(self) -> bytes:
        return _STATS.pack(
            self.attempts, self.generated, self.runs, self.passes, self.last_runs, self.last_mean, self.last_var,
            self.trained, self.last_epoch, self.last_step,
        ) + _TAIL.pack(self.skip_until)  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> KeptStats:
        tail = _TAIL.unpack_from(raw, _STATS.size) if len(raw) >= _STATS.size + _TAIL.size else (0,)
        return cls(*_STATS.unpack_from(raw), *tail)

    @property
    def band(self) -> str | None:
        """The band of its pass rate (PASS_BANDS); None for a prompt never generated."""
        if not self.runs:
            return None
        if not self.passes:
            return "zero"
        if self.passes == self.runs:
            return "all"
        return "low" if 2 * self.passes < self.runs else "high"


def stats_key(table_id: int, name: str, index: int) -> bytes:
    return layout.table_prefix(table_id) + b"s" + name.encode() + b"\0" + U64.pack(index)


def read_stats(txn: lmdb.Transaction[bytes], db: lmdb._Database, table_id: int, name: str, index: int) -> KeptStats:
    """A prompt's statistics (zero for one never handed out)."""
    raw = txn.get(stats_key(table_id, name, index), db=db)
    return KeptStats() if raw is None else KeptStats.decode(raw)


def _write(tt: TableState, name: str, index: int, stats: KeptStats) -> None:
    tt.txn.put(stats_key(tt.table_id, name, index), stats.encode(), db=tt.db["ledger"])


def claimed(tt: TableState, name: str, index: int) -> None:
    """A claim of the prompt was handed out."""
    stats = read_stats(tt.txn, tt.db["ledger"], tt.table_id, name, index)
    stats.attempts += 1
    _write(tt, name, index, stats)


def outcome(
    tt: TableState, ds: DatasetRecord, epoch: int, index: int, every: list[float | None]
) -> tuple[KeptStats, KeptStats]:
    """A group of the prompt complete: its rewards, in `epoch` (its runs in the table, or reported), into
    the prompt's statistics; the prompt into the band of its pass rate now (`ds`, written by the
    caller), and, its rewards all equal with zero_variance = "skip", out of the next skip_epochs
    epochs. Returns its statistics before and after."""
    stats = read_stats(tt.txn, tt.db["ledger"], tt.table_id, ds.name, index)
    before = replace(stats)
    was = stats.band
    if ds.zero_variance == "skip" and unvaried(every):
        stats.skip_until = max(stats.skip_until, epoch + 1 + ds.skip_epochs)
    rewards = [reward for reward in every if reward is not None]
    stats.generated += 1
    stats.runs += len(rewards)
    stats.passes += sum(1 for reward in rewards if reward > ds.pass_threshold)
    stats.last_runs = len(rewards)
    stats.last_mean = sum(rewards) / len(rewards) if rewards else math.nan
    # d * d, not d ** 2: a square past float's range is inf, where ** raises OverflowError
    spread = [reward - stats.last_mean for reward in rewards]
    stats.last_var = sum(d * d for d in spread) / len(rewards) if rewards else math.nan
    _write(tt, ds.name, index, stats)
    now = stats.band
    if was != now:
        if was is not None:
            ds.pass_bands[was] = ds.pass_bands.get(was, 0) - 1
        if now is not None:
            ds.pass_bands[now] = ds.pass_bands.get(now, 0) + 1
    return before, stats


def unvaried(rewards: list[float | None]) -> bool:
    """Whether a group of more than one run has its rewards all known and all equal (the table's
    drop_zero_variance filter, for a group of runs)."""
    return len(rewards) > 1 and zero_variance(rewards)


def trained(tt: TableState, name: str, epoch: int, index: int) -> None:
    """A group of the prompt was trained, in `epoch`, at the table's trainer version."""
    stats = read_stats(tt.txn, tt.db["ledger"], tt.table_id, name, index)
    stats.trained += 1
    stats.last_epoch = epoch
    version = tt.counters.trainer_version
    stats.last_step = -1 if version is None else version
    _write(tt, name, index, stats)
