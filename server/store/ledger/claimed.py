"""What a claim hands out (`Claimed`), what one transaction of a claim did (`ClaimStep`), and
how far its cursor walked in it (`Walk`): the records a claim's rules (claim_life.py) and the
claims service (services/claims.py) pass between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class Walk:
    """The cursor's walk in one transaction of a claim: the ownership hashes it spent, the parts
    of epochs a shard counted before the transaction (claims.py), by epoch, the epoch whose
    part it reached uncounted, where it stopped, and the epoch it may not start yet (the one two
    before it not done, hand_out.py), where the claim waits."""

    parts: Mapping[int, int] = field(default_factory=dict)
    hashes: int = 0
    uncounted: int | None = None
    waiting: int | None = None


@dataclass(frozen=True)
class ClaimStep:
    """What one transaction of a claim did: the prompts it handed out, whether the dataset is
    done, and whether it stopped short (`more`), its STEP_HASHES spent or, on a shard, the
    cursor at an epoch whose part is `uncounted`: to count outside the writer, then go on."""

    claimed: list[Claimed]
    done: bool
    more: bool
    uncounted: int | None = None


@dataclass(frozen=True)
class Claimed:
    """A prompt handed to a claimant: which, its attempt, and when its claim ends."""

    epoch: int
    index: int
    attempt: int
    expires: float
