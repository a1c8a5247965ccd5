"""From scores to advantages: token rewards (with the KL penalty when it is in the reward)
and the configured advantage estimator. Tensors are padded (b, r) over response tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshrl.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from meshrl.algorithms.rewards import token_level_rewards
from meshrl.config.schema import AlgorithmConfig


class AdvantageInputs(NamedTuple):
    scores: torch.Tensor  # (b,) sequence scores from the reward service
    mask: torch.Tensor  # (b, r) float, 1 on real response tokens
    group_ids: torch.Tensor  # (b,) int, responses of one prompt share an id
    values: torch.Tensor | None  # (b, r) critic values, gae only
    old_logprobs: torch.Tensor | None  # (b, r) actor log-probs before the update
    ref_logprobs: torch.Tensor | None  # (b, r) reference log-probs
    baseline_scores: torch.Tensor | None  # (b,) greedy-rollout scores, remax only
    # (b, r) a multi-turn rollout's environment rewards, each on its turn's last token
    turn_rewards: torch.Tensor | None = None


class AdvantageOutputs(NamedTuple):
    token_rewards: torch.Tensor  # (b, r)
    advantages: torch.Tensor  # (b, r)
    returns: torch.Tensor  # (b, r)
    kl_mean: float  # mean per-sequence KL to the reference (0 when KL is not in the reward)


def compute_advantages(
    cfg: AlgorithmConfig, inputs: AdvantageInputs, kl_coef: float
) -> AdvantageOutputs:
    """Token rewards, then the advantage estimator named by `cfg.adv_estimator`."""
    use_kl = cfg.use_kl_in_reward and inputs.ref_logprobs is not None
    rewards = token_level_rewards(
        inputs.scores,
        inputs.mask,
        logprobs=inputs.old_logprobs if use_kl else None,
        ref_logprobs=inputs.ref_logprobs if use_kl else None,
        kl_coef=kl_coef if use_kl else 0.0,
        kl_kind=cfg.kl_penalty,
    )
    # The outcome estimators baseline the whole response's reward, KL penalty included, as
    # verl's do (they sum `token_level_rewards`); without KL in the reward it is the score.
    sequence_rewards = inputs.scores - kl_coef * rewards.kl.sum(-1) if use_kl else inputs.scores
    if inputs.turn_rewards is not None:
        # per-turn rewards where they were earned (GAE, REINFORCE++ see each token's), and
        # in the episode's total for the outcome estimators
        rewards = rewards._replace(rewards=rewards.rewards + inputs.turn_rewards * inputs.mask)
        sequence_rewards = sequence_rewards + (inputs.turn_rewards * inputs.mask).sum(-1)
    est = cfg.adv_estimator
    if est == "gae":
        if inputs.values is None:
            raise ValueError("adv_estimator gae needs critic values (critic.enable)")
        result = gae_advantages(
            rewards.rewards,
            inputs.values,
            inputs.mask,
            cfg.gamma,
            cfg.lam,
            whiten=cfg.whiten_advantages,
        )
    elif est == "grpo":
        result = grpo_advantages(
            sequence_rewards, inputs.mask, inputs.group_ids, norm_by_std=cfg.norm_adv_by_std_in_grpo
        )
    elif est == "rloo":
        result = rloo_advantages(sequence_rewards, inputs.mask, inputs.group_ids)
    elif est == "reinforce_plus_plus":
        result = reinforce_plus_plus_advantages(rewards.rewards, inputs.mask, cfg.gamma)
    elif est == "reinforce_plus_plus_baseline":
        result = reinforce_plus_plus_baseline_advantages(
            sequence_rewards, inputs.mask, inputs.group_ids
        )
    elif est == "remax":
        if inputs.baseline_scores is None:
            raise ValueError("adv_estimator remax needs the greedy baseline scores")
        result = remax_advantages(rewards.rewards, inputs.baseline_scores, inputs.mask)
    else:  # the config schema already restricts the names
        raise ValueError(f"unknown adv_estimator {est!r}")
    kl_mean = float(rewards.kl_mean) if use_kl else 0.0
    return AdvantageOutputs(rewards.rewards, result.advantages, result.returns, kl_mean)
