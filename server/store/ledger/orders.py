"""Claim orders: in what order a dataset's cursor hands out each epoch's prompts, one class and
one registration each (`register`), named by the dataset's `order` setting with its options.

Every order hands out each prompt once an epoch (a claim that ends sends it back first, as
ever); it chooses which go first. The permutation walks the epoch's permutation of the seed. A
difficulty order sorts the prompts into bins by their durable statistics (`bin`) and draws a
bin for each prompt it hands out (`weights`, over the bins' prompts left in the epoch); the
first epoch, with no statistics yet, walks the permutation (binned.py keeps the bins). A draw
is a hash of the seed, the epoch and the draws made, so the choices depend only on what is
durable: after a kill -9 the next claims are the ones the order would have given without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from expbuf.client.schema.prompts import PromptStats

from ..schema.errors import ConfigError, clip
from .records import DatasetRecord

ORDERS: dict[str, type[ClaimOrder]] = {}


def register(order: type[ClaimOrder]) -> type[ClaimOrder]:
    """Make an order nameable by a dataset's `order` setting."""
    ORDERS[order.name] = order
    return order


class ClaimOrder:
    """An order's options (its `defaults`, overridden by the dataset's `order_options`), how it
    bins a prompt, and what each bin weighs in a draw. `bins` 0: the permutation every epoch."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, float]] = {}
    bins: ClassVar[int] = 0

    def __init__(self, options: Mapping[str, float]) -> None:
        self.options = {**self.defaults, **options}

    def check(self, where: str) -> None:
        """Refuse options the order does not know, or out of their range, naming them."""
        for key, value in self.options.items():
            if key not in self.defaults:
                known = ", ".join(self.defaults) or "none"
                raise ConfigError(f"{where}: order {self.name!r} has no option {clip(key)!r} (its options: {known})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{where}: order option {key} is {clip(value)}; it must be a finite number")

    def bin(self, stats: PromptStats) -> int:
        """The bin of a prompt with these statistics."""
        raise NotImplementedError

    def weights(self, counts: Sequence[int]) -> list[float]:
        """What each bin weighs in a draw, given its prompts left in the epoch (an empty bin: 0)."""
        raise NotImplementedError


@register
class PermutationOrder(ClaimOrder):
    """Each epoch in the permutation its seed fixes (index order without one): the default."""

    name = "permutation"


EASY, MEDIUM, HARD = range(3)


@register
class PoolsOrder(ClaimOrder):
    """Difficulty pools by the last group's mean reward: easy at `easy_above` or more, hard at
    `hard_below` or less, medium between (and a prompt never generated); each prompt handed out
    is drawn from a pool by its share (`easy_share`, `hard_share`, medium the rest), a pool with
    none left giving its share to the others."""

    name = "pools"
    defaults: ClassVar[dict[str, float]] = {"easy_share": 0.1, "hard_share": 0.1, "easy_above": 1.0, "hard_below": 0.0}
    bins = 3

    def check(self, where: str) -> None:
        super().check(where)
        easy, hard = self.options["easy_share"], self.options["hard_share"]
        if not (0.0 <= easy <= 1.0 and 0.0 <= hard <= 1.0 and easy + hard <= 1.0):
            raise ConfigError(
                f"{where}: easy_share {easy} and hard_share {hard} must each be in 0..1, and at most 1 together"
            )
        below, above = self.options["hard_below"], self.options["easy_above"]
        if below >= above:
            raise ConfigError(f"{where}: hard_below {below} must be below easy_above {above}")

    def bin(self, stats: PromptStats) -> int:
        mean = stats.last_mean
        if not stats.generated or math.isnan(mean):
            return MEDIUM
        if mean >= self.options["easy_above"]:
            return EASY
        return HARD if mean <= self.options["hard_below"] else MEDIUM

    def weights(self, counts: Sequence[int]) -> list[float]:
        easy, hard = self.options["easy_share"], self.options["hard_share"]
        shares = (easy, 1.0 - easy - hard, hard)
        weighed = [share if n else 0.0 for share, n in zip(shares, counts, strict=True)]
        if sum(weighed) > 0.0:
            return weighed
        return [1.0 if n else 0.0 for n in counts]  # every pool left has a share of 0: any of them


MIN_TAU = 1e-3  # below it a bin's weight underflows to 0 a band or two off the target's


@register
class PassRateOrder(ClaimOrder):
    """Prompts near a target pass rate first: a prompt's pass rate estimated by its Beta
    posterior, (passes + 1) / (runs + 2), as Trinity-RFT's diff_based selector estimates it;
    each prompt weighs exp(-|estimate - target| / tau), as in that selector's softmax, the
    estimates taken in `bins` bands of equal width (a bin weighs its prompts left)."""

    name = "pass_rate"
    defaults: ClassVar[dict[str, float]] = {"target": 0.5, "tau": 0.1}
    bins = 20

    def check(self, where: str) -> None:
        super().check(where)
        if not 0.0 <= self.options["target"] <= 1.0:
            raise ConfigError(f"{where}: target is {self.options['target']}; it must be a pass rate in 0..1")
        if not self.options["tau"] >= MIN_TAU:
            raise ConfigError(f"{where}: tau is {self.options['tau']}; it must be {MIN_TAU} or more")

    def bin(self, stats: PromptStats) -> int:
        estimate = (stats.passes + 1) / (stats.runs + 2)
        return min(int(estimate * self.bins), self.bins - 1)

    def weights(self, counts: Sequence[int]) -> list[float]:
        target, tau = self.options["target"], self.options["tau"]
        logits = [-abs((k + 0.5) / self.bins - target) / tau for k in range(self.bins)]
        top = max((logit for logit, n in zip(logits, counts, strict=True) if n), default=0.0)
        return [n * math.exp(logit - top) if n else 0.0 for logit, n in zip(logits, counts, strict=True)]


def order_of(ds: DatasetRecord, where: str = "") -> ClaimOrder:
    """The order a dataset names, with its options, checked; refuses a name not registered."""
    where = where or f"dataset {ds.name}"
    kind = ORDERS.get(ds.order)
    if kind is None:
        raise ConfigError(f"{where}: order is {clip(ds.order)!r}; expected one of {', '.join(ORDERS)}")
    order = kind(ds.order_options)
    order.check(where)
    return order
