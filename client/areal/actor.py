"""KeepExpbufAdvantages: AReaL's actor trains on the advantages the expbuf table computed."""

from __future__ import annotations

from typing import Any

from .convert import EXPBUF_ADVANTAGES


class KeepExpbufAdvantages:
    """A mixin in front of AReaL's actor (`class Actor(KeepExpbufAdvantages, FSDPPPOActor)`, or
    PPOActor itself): `compute_advantages` runs AReaL's own (reward shaping, the log-prob and
    loss-mask shift, KL rewards, returns), then each trajectory that carries the table's
    advantages (ExpbufBatchSource(advantages=True)) takes them as its `advantages`. They come
    already shifted, so they line up with AReaL's shifted `loss_mask`; AReaL's `adv_norm` is
    not applied to them (the table's estimator and advantage clip made them)."""

    def compute_advantages(self, data: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """AReaL's actor's own, then the table's advantages in place of its own where a trajectory has them."""
        # A mixin: the next class in the method resolution order is AReaL's actor.
        out: list[dict[str, Any]] = super().compute_advantages(data, *args, **kwargs)  # type: ignore[misc]
        for traj in out:
            ours = traj.pop(EXPBUF_ADVANTAGES, None)
            if ours is not None:
                traj["advantages"] = ours.to(traj["advantages"].dtype)
        return out
