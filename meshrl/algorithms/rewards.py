"""Token-level rewards: the sequence score on the last response token, minus an
optional per-token KL penalty to the reference model (KL in reward).

``r_t = score * [t == last] - beta * KL_t`` — Ziegler et al. 2019 ("Fine-Tuning
Language Models from Human Preferences"), Ouyang et al. 2022 (InstructGPT, eq. 2);
verl ``ray_trainer.apply_kl_penalty``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.kl import kl_penalty
from meshrl.algorithms.masked import masked_mean, zero_masked

__all__ = ["TokenRewards", "last_token_index", "place_on_last_token", "token_level_rewards"]


class TokenRewards(NamedTuple):
    """Output of :func:`token_level_rewards`."""

    rewards: Tensor
    """``(b, t)`` token rewards; 0 at masked positions."""
    kl: Tensor
    """``(b, t)`` per-token KL estimate, 0 at masked positions (all 0 without a ref)."""
    kl_mean: Tensor
    """Scalar: mean over sequences of the per-sequence masked mean KL
    (``actor/reward_kl_penalty``; feed it to the KL controller's ``update``)."""


def last_token_index(mask: Tensor) -> Tensor:
    """Index of each row's last valid token.

    Works for any mask, not only right padding (verl uses ``mask.sum(-1) - 1``, which is
    wrong when there are holes).

    Args:
        mask: ``(b, t)`` bool/float mask.

    Returns:
        ``(b,)`` int64; -1 for rows with no valid token.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return torch.where(mask != 0, positions, torch.full_like(positions, -1)).amax(dim=-1)


def place_on_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """Scatter ``scores`` ``(b,)`` onto each row's last valid token of a ``(b, t)`` zero
    tensor. Rows with no valid token get nothing (their score is dropped)."""
    mask = mask.to(scores.device)
    last = last_token_index(mask)
    has_token = last >= 0
    placed = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    placed[rows, last[has_token]] = scores[has_token]
    return placed


@torch.no_grad()
def token_level_rewards(
    scores: Tensor,
    response_mask: Tensor,
    *,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "kl",
) -> TokenRewards:
    """Turn sequence scores into token rewards, with an optional KL-in-reward penalty.

    ``rewards[i, t] = scores[i] * [t == last_i] - kl_coef * KL(logprobs, ref)[i, t] * m[i, t]``

    Args:
        scores: ``(b,)`` sequence scores from the reward function / model.
        response_mask: ``(b, t)`` bool/float response mask.
        logprobs: ``(b, t)`` log-probs of the rollout policy (verl: ``old_log_probs``).
        ref_logprobs: ``(b, t)`` log-probs of the reference model; with ``logprobs``
            enables the penalty (``algorithm.use_kl_in_reward``).
        kl_coef: ``beta``, the controller's current ``value``.
        kl_kind: estimator, see :data:`meshrl.algorithms.kl.KL_ESTIMATOR_KINDS`
            (``algorithm.kl_penalty``).

    Returns:
        :class:`TokenRewards`. Computed without grad: rewards are constants to PPO.
        The caller updates the KL controller with ``kl_mean`` and ``n_steps=b``.
    """
    if (logprobs is None) != (ref_logprobs is None):
        raise ValueError("pass both logprobs and ref_logprobs, or neither")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    rewards = place_on_last_token(scores.to(dtype), response_mask)
    if logprobs is None or ref_logprobs is None:  # both or neither (checked above)
        kl = torch.zeros_like(rewards)
    else:
        kl = zero_masked(kl_penalty(logprobs, ref_logprobs, kl_kind).to(dtype), response_mask)
    rewards = zero_masked(rewards - kl_coef * kl, response_mask)
    kl_mean = masked_mean(kl, response_mask, dim=-1).mean()
    return TokenRewards(rewards=rewards, kl=kl, kl_mean=kl_mean)
