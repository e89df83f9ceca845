"""The estimators a table can name: one registered record each.

An `Estimator` is everything expbuf knows of one: its name, its parameters (default and
allowed values), what it reads (a reward on every experience, or the tokens), what its
values are (one per experience, or token-level), whether it has a group step, and its two
stages: `ingest` runs when groups complete, `batch` finishes the stored pending values over
each sampled batch (see server/advantages/estimators.py). `register` adds one; table_config.py validates
a table against the record, the advantage worker and the batch stage run its stages.

A stage is a callable, or a "module:function" name imported when it first runs: reading
the registry (validating a table, checking a push's rewards in the storage engine) imports
no torch.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from expbuf.client.schema.table_settings import PARAM_CHOICES

# A stage: the function itself, or its "module:function" name.
Stage = Callable[..., Any] | str


@dataclass(frozen=True)
class Param:
    """One estimator parameter: its default (None: off unless set) and its allowed values.

    A numeric parameter lies in [low, high], each end open or closed; a parameter with
    `choices` takes one of those names, or its position among them (the form it has on the
    wire, whose parameter map holds numbers)."""

    default: float | str | None
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        """The allowed values, as error messages state them."""
        if self.choices:
            return " or ".join(f"{c!r} ({i})" for i, c in enumerate(self.choices))
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low == -math.inf:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{self.low:g} {'<' if self.low_open else '<='} x {'<' if self.high_open else '<='} {self.high:g}"

    def check(self, value: Any) -> float | None:
        """The value in its stored form (a number), or None when it is out of range."""
        if self.choices and isinstance(value, str):
            return float(self.choices.index(value)) if value in self.choices else None
        if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            return None
        if isinstance(value, bool) and self.choices != ("false", "true"):  # a flag's alone: true was "batch"
            return None
        try:
            number = float(value)
        except OverflowError:  # an int past a double's range: out of every parameter's
            return None
        if self.choices:
            return number if number.is_integer() and 0 <= number < len(self.choices) else None
        if number < self.low or (self.low_open and number == self.low):
            return None
        if number > self.high or (self.high_open and number == self.high):
            return None
        return number


def _always(args: dict[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class Estimator:
    """One estimator.

    `ingest(batch, **args)` gives its values for completed groups (None: the estimator
    computes nothing). `batch(rows, **args)` finishes the pending values of a sampled
    batch, for tables whose arguments make `batched(args)` true. `group_step`: it has a
    baseline or a scale over the group (LightRFT runs that step before the running
    normalisation and the reward clip, so these shape their values, the others their
    rewards); `group_step_in_batch`: its batch stage completes that group step (a std over
    the batch), so it runs before the advantage clip, where a batch stage that whitens
    runs after it. `needs_reward`: a push without a reward is refused (the others take
    token_level_reward instead); `token_level`: it reads the tokens (masks and token-level
    rewards); `token_valued`: its values are token-level, not one per experience."""

    name: str
    params: dict[str, Param] = field(default_factory=dict)
    ingest: Stage | None = None
    batch: Stage | None = None
    batched: Callable[[dict[str, Any]], bool] = _always
    needs_reward: bool = True
    token_level: bool = False
    token_valued: bool = False
    group_step: bool = False
    group_step_in_batch: bool = False
    # What every generated token of an experience carries, in the words and symbols of the
    # estimators page (docs/concepts/estimators.md), which shows it: r the reward, s the score.
    value: str = ""
    # When the batch stage runs, for an estimator whose arguments decide it (`batched`).
    batch_when: str = ""

    def args(self, stored: dict[str, float]) -> dict[str, float | str | None]:
        """Its keyword arguments: the table's stored parameters over the defaults, choices by name."""
        args: dict[str, float | str | None] = {}
        for name, param in self.params.items():
            value = stored.get(name, param.default)
            args[name] = param.choices[int(value)] if param.choices and isinstance(value, float | int) else value
        return args

    def has_batch_stage(self, args: dict[str, Any]) -> bool:
        """Whether its batch stage runs with these arguments."""
        return self.batch is not None and self.batched(args)

    def ingest_stage(self) -> Callable[..., Any]:
        if self.ingest is None:
            raise ValueError(f"estimator {self.name} computes no advantages")
        return _resolve(self.ingest)

    def batch_stage(self) -> Callable[..., Any]:
        if self.batch is None:
            raise ValueError(f"estimator {self.name} has no batch stage")
        return _resolve(self.batch)


def _resolve(stage: Stage) -> Callable[..., Any]:
    if callable(stage):
        return stage
    module, _, name = stage.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return found


# Every estimator by name, in the order error messages list them.
ESTIMATORS: dict[str, Estimator] = {}


def register(estimator: Estimator, *, replace: bool = False) -> Estimator:
    """Make an estimator available to tables under its name; a name taken already is
    refused unless `replace`."""
    if estimator.name in ESTIMATORS and not replace:
        raise ValueError(f"estimator {estimator.name} is registered already")
    ESTIMATORS[estimator.name] = estimator
    return estimator


def unregister(name: str) -> None:
    """Remove an estimator (tables that name it no longer validate)."""
    ESTIMATORS.pop(name, None)


def _std_over_batch(args: dict[str, Any]) -> bool:
    return bool(args["std_cal_level"] == "batch")


_TORCH = "expbuf.server.advantages.estimators:"
_EPSILON = Param(1e-6, low=0.0, low_open=True)
_THRESHOLD = Param(None, low=0.0)
_STD_LEVEL = Param("group", choices=PARAM_CHOICES["std_cal_level"])
_FLAG = Param(0.0, choices=PARAM_CHOICES["std_normalize"])
_BASELINE = Param("mean", choices=PARAM_CHOICES["opmd_baseline"])
_TAU = Param(1.0, low=0.0, low_open=True)
_SHIFT = Param(-0.1)
_DISCOUNT = Param(1.0, low=0.0, high=1.0, low_open=True)

# Trinity-RFT 0.6.0's estimators, under its names for its functions and their parameters.
register(
    Estimator(
        "grpo",
        {"epsilon": _EPSILON, "std_threshold": _THRESHOLD, "std_cal_level": _STD_LEVEL},
        ingest=_TORCH + "grpo",
        batch=_TORCH + "finish_grpo",
        batched=_std_over_batch,
        group_step=True,
        group_step_in_batch=True,
        value=(
            '(r − μ_g) / (σ_g + ε); with `std_cal_level = "batch"` σ is that of the sampled '
            "batch's rewards (1 for a batch of one); with `std_threshold` set, groups of one "
            "and groups with σ_g ≤ it are dropped"
        ),
        batch_when='std_cal_level = "batch"',
    )
)
register(
    Estimator(
        "grpo_verl",
        {"epsilon": _EPSILON},
        ingest=_TORCH + "grpo_verl",
        needs_reward=False,
        token_level=True,
        group_step=True,
        value="(s − μ_g) / (σ_g + ε) over the scores",
    )
)
register(
    Estimator(
        "step_wise_grpo",
        {"epsilon": _EPSILON, "enable_step_norm": _FLAG, "std_cal_level": _STD_LEVEL, "std_threshold": _THRESHOLD},
        ingest=_TORCH + "step_wise_grpo",
        batch=_TORCH + "finish_step_wise_grpo",
        batched=_std_over_batch,
        group_step=True,
        group_step_in_batch=True,
        value=(
            "grpo over the last step of each run of a group (its highest `step` number; "
            "Trinity-RFT takes the last in its list, the same step when a run's steps are "
            "listed in order, as its workflows list them, while expbuf's arrival order is not"
            " a run's order); every step of the run carries it (÷ the run's number of steps "
            'with `enable_step_norm`); "batch": σ of the sampled batch\'s last-step rewards'
        ),
        batch_when='std_cal_level = "batch"',
    )
)
register(
    Estimator(
        "reinforceplusplus",
        {"gamma": _DISCOUNT},
        ingest=_TORCH + "reinforceplusplus",
        batch=_TORCH + "finish_reinforceplusplus",
        needs_reward=False,
        token_level=True,
        token_valued=True,
        value=(
            "per token G_t = r_t + γ·G_{t+1} of the token-level rewards (through masked "
            "tokens), whitened over the sampled batch's generated tokens: (G − mean) / √(var "
            "+ 1e-8), unbiased var; no group baseline"
        ),
    )
)
register(Estimator("reinforce", ingest=_TORCH + "reinforce", value="r"))
register(
    Estimator(
        "rloo",
        ingest=_TORCH + "rloo",
        needs_reward=False,
        token_level=True,
        group_step=True,
        value="s − (Σ_g s − s) / (n_g − 1)",
    )
)
register(
    Estimator(
        "opmd",
        {"opmd_baseline": _BASELINE, "tau": _TAU},
        ingest=_TORCH + "opmd",
        group_step=True,
        value=('r − b_g, b_g = μ_g, or with `opmd_baseline = "logavgexp"` τ·log(mean_g exp(r/τ))'),
    )
)
register(
    Estimator(
        "opmd_verl",
        {"opmd_baseline": _BASELINE, "tau": _TAU},
        ingest=_TORCH + "opmd_verl",
        needs_reward=False,
        token_level=True,
        group_step=True,
        value="`opmd` over the scores",
    )
)
register(
    Estimator("asymre", {"baseline_shift": _SHIFT}, ingest=_TORCH + "asymre", group_step=True, value="r − (μ_g + δ)")
)
register(
    Estimator(
        "asymre_verl",
        {"baseline_shift": _SHIFT},
        ingest=_TORCH + "asymre_verl",
        needs_reward=False,
        token_level=True,
        group_step=True,
        value="`asymre` over the scores",
    )
)
register(
    Estimator(
        "rec",
        {"epsilon": _EPSILON, "std_normalize": _FLAG},
        ingest=_TORCH + "rec",
        group_step=True,
        value=(
            "r − μ_g, or with `std_normalize` (r − μ_g) / (σ'_g + ε), σ' the population std; "
            "a group of one keeps r (Trinity-RFT raises on it)"
        ),
    )
)
# expbuf's own estimators, with no Trinity-RFT counterpart of the same meaning.
register(Estimator("drgrpo", ingest=_TORCH + "drgrpo", group_step=True, value="r − μ_g"))
register(
    Estimator(
        "reinforce++_baseline",
        {"epsilon": Param(1e-8, low=0.0, low_open=True)},
        ingest=_TORCH + "reinforce_pp_baseline",
        batch=_TORCH + "finish_reinforce_pp_baseline",
        group_step=True,
        value=(
            "verl's group-baseline REINFORCE++: x = r − μ_g, whitened over the sampled "
            "batch's generated tokens: (x − mean) / √(var + ε), unbiased var"
        ),
    )
)
register(
    Estimator(
        "discounted_return",
        {"gamma": _DISCOUNT},
        ingest=_TORCH + "discounted_return",
        needs_reward=False,
        token_level=True,
        token_valued=True,
        value=("per token G_t = r_t + γ·G_{t+1} of the token-level rewards, through masked tokens"),
    )
)
register(
    Estimator(
        "multi_turn_discount",
        {"turn_level_discount": _DISCOUNT},
        ingest=_TORCH + "multi_turn_discount",
        value="per run, over steps 0..T−1: G_t = r_t + γ·G_{t+1}",
    )
)
register(Estimator("none", needs_reward=False, value="advantages stay as pushed"))
