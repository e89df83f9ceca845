"""Running moments of a table's rewards (reward shaping's running normalisation), apart from
the shaping steps so that what reads them (Stats, metrics) imports no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class SupportsToList(Protocol):
    """A tensor, as far as the moments need one."""

    def tolist(self) -> list[float]: ...


@dataclass(frozen=True)
class RunningMoments:
    """Running mean and variance of every value taken in (Chan et al.'s parallel merge, as
    LightRFT's RunningMoments). `count` starts at a tiny value and `var` at 1, so that the
    first update gives the moments of its own values."""

    mean: float = 0.0
    var: float = 1.0  # population variance
    count: float = 1e-24

    @property
    def std(self) -> float:
        """The unbiased standard deviation of everything seen: 1 before anything, infinite
        after a single value (LightRFT divides by count - 1 = 0 there)."""
        if self.count < 1:
            return 1.0
        if self.count == 1:
            return math.inf
        return math.sqrt(self.var * self.count / (self.count - 1))

    @classmethod
    def of(cls, stored: list[float] | None) -> RunningMoments:
        """The moments as a table's counters keep them (None before any value)."""
        return cls(*stored) if stored else cls()

    def stored(self) -> list[float]:
        """The form the table's counters keep."""
        return [self.mean, self.var, self.count]

    def update(self, values: Sequence[float] | SupportsToList) -> RunningMoments:
        """These moments with the values taken in (exact sums: the order of the values
        within one update does not matter)."""
        values = values.tolist() if isinstance(values, SupportsToList) else list(values)
        n = len(values)
        if n == 0:
            return self
        batch_mean = math.fsum(values) / n
        batch_var = math.fsum((v - batch_mean) ** 2 for v in values) / n
        delta = batch_mean - self.mean
        total = self.count + n
        merged = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        return RunningMoments(self.mean + delta * n / total, merged / total, total)

    def normalise(self, values: list[float], minus_mean: bool) -> list[float]:
        """Values scaled by these moments; 0 where the std is infinite or 0."""
        std = self.std
        if std == 0 or math.isinf(std):
            return [0.0] * len(values)
        mean = self.mean if minus_mean else 0.0
        return [(v - mean) / std for v in values]
