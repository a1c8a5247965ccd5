"""CISPO's policy loss (``policy_loss.loss_mode=cispo``): the importance weight clipped and
detached, the gradient through the log-prob alone, so that no token leaves the update.

Sign convention as :mod:`meshrl.algorithms.policy_loss`: the loss is minimised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.algorithms.aggregation import aggregate_loss
from meshrl.algorithms.loss_modes import PolicyLossInputs, PolicyLossSettings
from meshrl.algorithms.masked import masked_mean, valid_positions
from meshrl.algorithms.policy_loss import PolicyLoss

__all__ = ["cispo", "cispo_policy_loss"]


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """CISPO, clipped IS-weight policy optimization (MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention", eq. 4-5; verl
    ``policy_loss.loss_mode=cispo``).

    PPO's clip takes a token whose ratio left ``[1 - low, 1 + high]`` out of the gradient;
    the rare tokens a reasoning model learns to fork on ("However", "Wait") are those first
    clipped. CISPO clips the importance weight instead and stops its gradient, so every token
    keeps the REINFORCE gradient of its own log-prob, weighted at most ``1 + high``. Per
    token, with ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``::

        w_t  = sg[clip(r_t, 1 - low, 1 + high)]
        pg_t = -w_t * A_t * logprobs_t            (gradient: -w_t * A_t * d logprobs_t)
        pg_t = pg_t * is_weights_t                if given

    then aggregated with :func:`~meshrl.algorithms.aggregation.aggregate_loss`. No dual
    clip. The paper bounds the weight above only (``low`` large: ``1 - low <= 0`` leaves no
    lower bound) and tunes ``high``. The loss's value is not PPO's (it is ``log π``
    weighted, negative for ``A < 0``); only its gradient matters.

    Args:
        logprobs: ``(b, t)`` current log-probs (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch.
        advantages: ``(b, t)`` advantages.
        mask: ``(b, t)`` response mask.
        clip_ratio_low: ``epsilon_low`` of the weight.
        clip_ratio_high: ``epsilon_high`` of the weight.
        loss_agg_mode: see :data:`meshrl.algorithms.aggregation.LOSS_AGG_MODES`.
        global_token_count: mini-batch token count for micro-batch accumulation.
        global_seq_count: mini-batch sequence count for micro-batch accumulation.
        norm_length: constant ``T`` of ``seq-mean-token-sum-norm`` (default: this ``t``).
        is_weights: ``(b, t)`` per-token weights (truncated importance sampling); detached.

    Returns:
        :class:`~meshrl.algorithms.policy_loss.PolicyLoss`: ``clipfrac`` the fraction of
        valid tokens whose weight was clipped at either bound (verl's ``pg_clipfrac`` of this
        mode), ``clipfrac_lower`` those clipped at the lower bound, ``approx_kl`` the
        token-level k1 as for PPO.
    """
    valid = valid_positions(mask, logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # padding to 0 before any arithmetic: garbage there never reaches exp or the gradient
    logp = torch.where(valid, logprobs, zero)  # (b, t)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).clamp(-20.0, 20.0)
    adv = torch.where(valid, advantages, zero)
    ratio = log_ratio.detach().exp()  # (b, t), no gradient: the weight is detached
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = -weight * adv * logp
    if is_weights is not None:
        pg = pg * torch.where(valid, is_weights.detach(), zero)
    loss = aggregate_loss(
        pg,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    return PolicyLoss(
        loss=loss,
        clipfrac=masked_mean((weight != ratio).to(pg.dtype), mask).detach(),
        clipfrac_lower=masked_mean((ratio < 1.0 - clip_ratio_low).to(pg.dtype), mask).detach(),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
    )


def cispo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """The registered form (meshrl/algorithms/registry.py): the weight clipped at
    ``clip_ratio_low`` / ``clip_ratio_high``, aggregated by ``loss_agg_mode``."""
    return cispo_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        loss_agg_mode=s.loss_agg_mode, is_weights=x.is_weights,
        global_token_count=x.global_token_count, global_seq_count=x.global_seq_count,
    )  # fmt: skip
