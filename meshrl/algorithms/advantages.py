"""Advantage estimators (``algorithm.adv_estimator``), as pure functions of tensors; the
registry (meshrl/algorithms/registry.py) names them and says what each needs.

Every estimator returns :class:`AdvantageResult` ``(advantages, returns)``, both
``(b, t)`` and exactly 0 where the mask is 0. All run under ``torch.no_grad``:
advantages and returns are regression / policy-gradient *targets*.

Masks with holes (mask 0 between valid tokens, e.g. tool observations in a multi-turn
rollout) are handled as verl's masked GAE does: masked positions are *skipped*, i.e.
transparent. Their rewards and values are ignored and the recursion carries across them
as if they were not there (discounting counts valid tokens only). For right padding
this equals "the value and return after the last valid token are 0".

Group-based estimators (GRPO, RLOO, REINFORCE++-baseline) take sequence scores
``(b,)`` and ``group_ids`` ``(b,)``; a "singleton" group (one response for a prompt)
has no baseline, and they follow verl there (see each function).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.groups import group_stats
from meshrl.algorithms.masked import masked_whiten, valid_positions, zero_masked
from meshrl.algorithms.registry import ESTIMATORS

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageResult",
    "discounted_return_to_go",
    "gae_advantages",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]

ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)
"""The names of ``algorithm.adv_estimator``, from the registry (meshrl/algorithms/registry.py)."""

GroupIds = Tensor | Sequence[Hashable]


class AdvantageResult(NamedTuple):
    """Output of every advantage estimator."""

    advantages: Tensor
    """``(b, t)`` advantages, 0 at masked positions."""
    returns: Tensor
    """``(b, t)`` value targets (critic regression targets for GAE), 0 at masked positions."""


def _check_token_shapes(mask: Tensor, *tensors: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (b, t), got {tuple(mask.shape)}")
    for x in tensors:
        if x.shape != mask.shape:
            raise ValueError(f"expected shape {tuple(mask.shape)}, got {tuple(x.shape)}")


def _broadcast_scores(per_seq: Tensor, mask: Tensor) -> Tensor:
    # (b,) -> (b, t), zero on padding: outcome advantages are shared by all tokens.
    return zero_masked(per_seq[:, None].expand(mask.shape), mask)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> AdvantageResult:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional
    Continuous Control Using Generalized Advantage Estimation"), masked as verl's
    ``compute_gae_advantage_return``.

    Backwards over valid tokens, with ``V_next = 0`` after the last one::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    Masked positions are skipped: ``V_next`` and ``A_next`` carry over them unchanged,
    and the rewards / values stored there are ignored.

    Args:
        token_rewards: ``(b, t)`` token rewards (score on the last token, KL penalty).
        values: ``(b, t)`` critic values ``V(s_t)`` from the rollout-time critic.
        mask: ``(b, t)`` response mask.
        gamma: discount ``algorithm.gamma``.
        lam: GAE lambda ``algorithm.lam``.
        whiten: normalise advantages over all valid tokens of the batch (verl always
            does). Returns are never whitened.

    Returns:
        :class:`AdvantageResult`; ``returns`` are computed from the raw advantages.
    """
    _check_token_shapes(mask, token_rewards, values)
    valid = valid_positions(mask, values)
    zeros = torch.zeros_like(values[:, 0])
    next_value, next_adv = zeros, zeros
    advantages = torch.zeros_like(values)
    # The recursion is sequential in t; it is vectorised over the batch.
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        advantages[:, t] = torch.where(valid[:, t], adv_t, zeros)
    returns = zero_masked(advantages + values, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return AdvantageResult(advantages=advantages, returns=returns)


@torch.no_grad()
def discounted_return_to_go(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = sum_{k >= t, valid} gamma^(#valid tokens strictly between) * r_k``.

    Masked positions are skipped like in :func:`gae_advantages`: their rewards are
    ignored and the sum carries across them. For right padding this is the plain
    reward-to-go that restarts at 0 after the last valid token.

    Args:
        token_rewards: ``(b, t)`` token rewards.
        mask: ``(b, t)`` response mask.
        gamma: discount.

    Returns:
        ``(b, t)`` return-to-go, 0 at masked positions.
    """
    _check_token_shapes(mask, token_rewards)
    valid = valid_positions(mask, token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    mask: Tensor,
    group_ids: GroupIds,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> AdvantageResult:
    """Group-relative outcome advantage (Shao et al. 2024, DeepSeekMath, GRPO):
    ``A_i = (s_i - mean_g) / (std_g + eps)`` on every token of response ``i``.

    ``norm_by_std=False`` gives Dr. GRPO's ``A_i = s_i - mean_g`` (Liu et al. 2025,
    "Understanding R1-Zero-Like Training"), ``algorithm.norm_adv_by_std_in_grpo``.
    ``std_g`` is unbiased (``torch.std``).

    Singleton groups, as verl ``compute_grpo_outcome_advantage``: mean 0 and std 1,
    so ``A = s / (1 + eps)`` (``A = s`` without std normalisation). The raw score
    then acts as the advantage; use ``rollout.n > 1`` to get a baseline.

    Args:
        scores: ``(b,)`` sequence scores (verl: ``token_level_rewards.sum(-1)``).
        mask: ``(b, t)`` response mask.
        group_ids: ``(b,)`` prompt/group id per sequence (int tensor or hashables).
        norm_by_std: divide by the group std.
        eps: added to the std.

    Returns:
        :class:`AdvantageResult` with ``returns == advantages``.
    """
    stats = group_stats(scores, group_ids)
    singleton = stats.size == 1
    mean = torch.where(singleton, torch.zeros_like(stats.mean), stats.mean)
    std = torch.where(singleton, torch.ones_like(stats.std), stats.std)
    per_seq = scores - mean
    if norm_by_std:
        per_seq = per_seq / (std + eps)
    advantages = _broadcast_scores(per_seq, mask)
    return AdvantageResult(advantages=advantages, returns=advantages.clone())


@torch.no_grad()
def rloo_advantages(scores: Tensor, mask: Tensor, group_ids: GroupIds) -> AdvantageResult:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to
    Basics"): the baseline of response ``i`` is the mean score of the *other* responses
    of its group::

        A_i = s_i - (sum_g - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_g)

    so the advantages of a group sum to 0. Singleton groups, as verl
    ``compute_rloo_outcome_advantage``: no baseline, ``A = s``.

    Args:
        scores: ``(b,)`` sequence scores.
        mask: ``(b, t)`` response mask.
        group_ids: ``(b,)`` group id per sequence.

    Returns:
        :class:`AdvantageResult` with ``returns == advantages``.
    """
    stats = group_stats(scores, group_ids)
    n = stats.size.to(scores.dtype)
    scale = n / torch.where(stats.size > 1, n - 1, torch.ones_like(n))
    per_seq = torch.where(stats.size > 1, (scores - stats.mean) * scale, scores)
    advantages = _broadcast_scores(per_seq, mask)
    return AdvantageResult(advantages=advantages, returns=advantages.clone())


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"): discounted return-to-go of the token rewards (which carry
    the per-token KL penalty), whitened over all valid tokens of the batch.

    Holes in the mask are skipped (see :func:`discounted_return_to_go`). verl's
    ``compute_reinforce_plus_plus_outcome_advantage`` (0.9.1 too) instead multiplies its
    running return by each position's mask after storing it, so a hole cuts the sum; the
    two agree for right padding, the only layout rollout produces.

    Args:
        token_rewards: ``(b, t)`` token rewards.
        mask: ``(b, t)`` response mask.
        gamma: discount ``algorithm.gamma``.

    Returns:
        :class:`AdvantageResult`: whitened advantages; ``returns`` = un-whitened
        return-to-go.
    """
    returns = discounted_return_to_go(token_rewards, mask, gamma)
    return AdvantageResult(advantages=masked_whiten(returns, mask), returns=returns)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, mask: Tensor, group_ids: GroupIds, eps: float = 1e-8
) -> AdvantageResult:
    """REINFORCE++-baseline (verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``):
    subtract the group mean score, broadcast over the response tokens, then whiten
    over all valid tokens of the batch (so longer responses weigh more in the
    statistics, as in verl).

    Singleton groups: mean 0 (verl), i.e. the raw score before whitening.

    Args:
        scores: ``(b,)`` sequence scores.
        mask: ``(b, t)`` response mask.
        group_ids: ``(b,)`` group id per sequence.
        eps: added to the batch variance inside the square root when whitening; 1e-8,
            what verl whitens with (it declares an ``epsilon`` it does not pass on).

    Returns:
        :class:`AdvantageResult` with ``returns == advantages``.
    """
    stats = group_stats(scores, group_ids)
    mean = torch.where(stats.size == 1, torch.zeros_like(stats.mean), stats.mean)
    centred = _broadcast_scores(scores - mean, mask)
    advantages = masked_whiten(centred, mask, eps=eps)
    return AdvantageResult(advantages=advantages, returns=advantages.clone())


@torch.no_grad()
def remax_advantages(
    token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor
) -> AdvantageResult:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning LLMs"): undiscounted return-to-go minus the score of
    the greedy response to the same prompt (verl ``compute_remax_outcome_advantage``).

    Args:
        token_rewards: ``(b, t)`` token rewards.
        baseline_scores: ``(b,)`` score of the greedy (argmax) decode of each prompt.
        mask: ``(b, t)`` response mask.

    Returns:
        :class:`AdvantageResult`; ``returns`` = return-to-go (gamma = 1).
    """
    returns = discounted_return_to_go(token_rewards, mask, 1.0)
    advantages = zero_masked(returns - baseline_scores.to(returns.dtype)[:, None], mask)
    return AdvantageResult(advantages=advantages, returns=returns)
