"""From scores to advantages: token rewards (with the KL penalty when it is in the reward)
and the configured advantage estimator. Tensors are padded (b, r) over response tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshrl.algorithms.estimators import EstimatorInputs
from meshrl.algorithms.registry import advantage_estimator
from meshrl.algorithms.rewards import token_level_rewards
from meshrl.config.sections import AlgorithmConfig


class AdvantageInputs(NamedTuple):
    scores: torch.Tensor  # (b,) sequence scores from the reward service
    mask: torch.Tensor  # (b, r) float, 1 on real response tokens
    group_ids: torch.Tensor  # (b,) int, responses of one prompt share an id
    values: torch.Tensor | None  # (b, r) critic values, for an estimator that needs_critic
    old_logprobs: torch.Tensor | None  # (b, r) actor log-probs before the update
    ref_logprobs: torch.Tensor | None  # (b, r) reference log-probs
    baseline_scores: torch.Tensor | None  # (b,) greedy-rollout scores, needs_greedy_baseline
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
    """Token rewards, then the advantage estimator named by `cfg.adv_estimator` (its entry in
    meshrl/algorithms/registry.py), given what the entry says it needs."""
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
    entry = advantage_estimator(cfg.adv_estimator)
    if entry.needs_critic and inputs.values is None:
        raise ValueError(f"adv_estimator {entry.name} needs critic values (critic.enable)")
    if entry.needs_greedy_baseline and inputs.baseline_scores is None:
        raise ValueError(f"adv_estimator {entry.name} needs the greedy baseline scores")
    estimate = entry.load()
    result = estimate(
        EstimatorInputs(
            token_rewards=rewards.rewards,
            sequence_rewards=sequence_rewards,
            mask=inputs.mask,
            group_ids=inputs.group_ids,
            values=inputs.values,
            baseline_scores=inputs.baseline_scores,
        ),
        cfg,
    )
    kl_mean = float(rewards.kl_mean) if use_kl else 0.0
    return AdvantageOutputs(rewards.rewards, result.advantages, result.returns, kl_mean)
