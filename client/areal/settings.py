"""expbuf table settings that agree with an AReaL experiment's config.

AReaL's bound (max_head_offpolicyness k over consumer_batch_size trajectories, each one
prompt's group) is the table's max_staleness k over batch_size groups; gconfig.n_samples is the
group's size; the agent's turn discount is `multi_turn_discount`; the actor's reward clip and
overlong penalty are the table's shaping, in AReaL's order (penalty, then clip).
"""

from __future__ import annotations

from typing import Any


def table_settings(rollout: Any, gconfig: Any = None, actor: Any = None, turn_discount: float | None = None) -> dict:
    """create_table(**settings) for AReaL's InferenceEngineConfig `rollout`, its
    GenerationHyperparameters `gconfig`, PPOActorConfig `actor` and, for agents, the turn
    discount (AgentConfig.turn_discount; its groups vary in size, so they complete on push).

    The turn discount belongs to the table only when the interactions' rewards are each turn's
    own: AReaL's agent proxy discounts them itself when it exports them, and a second discount
    would count later turns twice. With an `actor`, the estimator is `reinforce` (each generated
    token's advantage the shaped reward), what AReaL's actor computes with no KL, critic or
    normalisation: the table's default (grpo) gave group-normalised values where `trainer_side`
    said they were AReaL's; the settings `trainer_side` lists are AReaL's to compute. With a turn
    discount the actor's reward clip and overlong penalty are left to AReaL too: it applies them
    to each turn's discounted return, where the table shapes a reward before its estimator."""
    settings: dict[str, Any] = {
        "group_by": "task",
        "max_staleness": rollout.max_head_offpolicyness,
        "batch_size": rollout.consumer_batch_size,
        "group_size": 0 if turn_discount is not None or gconfig is None else gconfig.n_samples,
    }
    if turn_discount is not None:
        settings["estimator"] = "multi_turn_discount"
        settings["estimator_params"] = {"turn_level_discount": turn_discount}
    if actor is not None:
        settings.setdefault("estimator", "reinforce")
        if turn_discount is None:  # AReaL clips and penalises the discounted return: `trainer_side` lists them
            settings["shaping"] = shaping(actor)
    return settings


def shaping(actor: Any) -> dict[str, Any]:
    """The table's shaping for a PPOActorConfig's reward clip and overlong penalty."""
    out: dict[str, Any] = {"reward_clip": float(actor.reward_clip)}
    if actor.overlong_reward_penalty:
        out.update(
            overlong_buffer=True,
            overlong_buffer_len=actor.overlong_tokens,
            max_new_tokens=actor.max_new_tokens,
            overlong_buffer_penalty_factor=float(actor.overlong_penalty_factor),
        )
    return out


def trainer_side(actor: Any, turn_discount: float | None = None) -> list[str]:
    """The actor settings in use that a table's advantages leave out: they need the trainer's
    forwards (a critic's values for GAE, the reference model's log-probs for KL) or AReaL's own
    reward transforms (with a turn discount, its clip and overlong penalty of the discounted
    return: `table_settings`). Empty when the table's advantages are what AReaL's actor would compute."""
    found = []
    if turn_discount is not None:
        found.append(f"reward_clip={actor.reward_clip} (AReaL clips each turn's discounted return)")
        if actor.overlong_reward_penalty:
            found.append("overlong_reward_penalty (AReaL penalises each turn's discounted return)")
    if actor.kl_ctl:
        found.append(f"kl_ctl={actor.kl_ctl} (KL rewards need the reference model's log-probs)")
    if actor.discount != 1.0 or actor.gae_lambda != 1.0:
        found.append(f"discount={actor.discount}, gae_lambda={actor.gae_lambda} (token-level GAE)")
    if actor.reward_bias or actor.reward_scaling != 1.0:
        found.append(f"reward_bias={actor.reward_bias}, reward_scaling={actor.reward_scaling}")
    if actor.reward_norm is not None:
        found.append("reward_norm (AReaL's group or batch normalisation of rewards)")
    if actor.adv_norm is not None:
        found.append("adv_norm (AReaL's normalisation of advantages)")
    if actor.mask_no_eos_with_zero:
        found.append("mask_no_eos_with_zero")
    return found
