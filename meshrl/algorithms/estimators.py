"""The advantage estimators in the one form the registry names
(:data:`meshrl.algorithms.registry.ADVANTAGE_ESTIMATORS`): ``(EstimatorInputs,
AlgorithmConfig) -> AdvantageResult``. Each is one call of its pure function in
:mod:`meshrl.algorithms.advantages`, with the config's values as its arguments.

The caller (the coordinator's advantage phase) gives an estimator what its entry declares
it needs: ``values`` where it ``needs_critic``, ``baseline_scores`` where it
``needs_greedy_baseline``; an estimator may assert them.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from meshrl.algorithms.advantages import (
    AdvantageResult,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from meshrl.config.sections import AlgorithmConfig

__all__ = [
    "EstimatorInputs",
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]


class EstimatorInputs(NamedTuple):
    """What the advantage phase has for an estimator; ``t`` response tokens."""

    token_rewards: Tensor
    """``(b, t)`` token rewards: the score on the last token, the KL penalty when it is in
    the reward, a multi-turn rollout's turn rewards on their turns' last tokens."""
    sequence_rewards: Tensor
    """``(b,)`` each response's whole reward (the score, minus its KL penalty when that is
    in the reward, plus its turn rewards): what the outcome estimators baseline."""
    mask: Tensor
    """``(b, t)`` 1 on the response tokens."""
    group_ids: Tensor
    """``(b,)`` int, the same for the responses to one prompt."""
    values: Tensor | None
    """``(b, t)`` the critic's values; given where the entry ``needs_critic``."""
    baseline_scores: Tensor | None
    """``(b,)`` the greedy response's score; given where the entry ``needs_greedy_baseline``."""


def gae(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.gae_advantages` with γ, λ and whitening."""
    assert x.values is not None  # needs_critic: the caller checked
    return gae_advantages(
        x.token_rewards, x.values, x.mask, cfg.gamma, cfg.lam, whiten=cfg.whiten_advantages
    )


def grpo(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.grpo_advantages`; Dr. GRPO without the std."""
    return grpo_advantages(
        x.sequence_rewards, x.mask, x.group_ids, norm_by_std=cfg.norm_adv_by_std_in_grpo
    )


def rloo(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.rloo_advantages`."""
    return rloo_advantages(x.sequence_rewards, x.mask, x.group_ids)


def reinforce_plus_plus(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.reinforce_plus_plus_advantages` with γ."""
    return reinforce_plus_plus_advantages(x.token_rewards, x.mask, cfg.gamma)


def reinforce_plus_plus_baseline(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.reinforce_plus_plus_baseline_advantages`."""
    return reinforce_plus_plus_baseline_advantages(x.sequence_rewards, x.mask, x.group_ids)


def remax(x: EstimatorInputs, cfg: AlgorithmConfig) -> AdvantageResult:
    """:func:`~meshrl.algorithms.advantages.remax_advantages` (undiscounted: γ unused)."""
    assert x.baseline_scores is not None  # needs_greedy_baseline: the caller checked
    return remax_advantages(x.token_rewards, x.baseline_scores, x.mask)
