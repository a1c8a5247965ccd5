"""PPO clipped policy-gradient loss with dual clip, GSPO's sequence-level variant, and
truncated importance sampling for the rollout-engine / trainer log-prob mismatch.

Sign convention: the loss is *minimised*; a positive advantage lowers the loss when
the token's probability rises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.aggregation import aggregate_loss
from meshrl.algorithms.masked import masked_mean, valid_positions

__all__ = [
    "PolicyLoss",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "rollout_mismatch_metrics",
    "truncated_is_weights",
]


class PolicyLoss(NamedTuple):
    """Output of :func:`ppo_policy_loss`; all scalars."""

    loss: Tensor
    """Aggregated PPO loss, with grad (``actor/pg_loss``)."""
    clipfrac: Tensor
    """Fraction of valid tokens whose clipped surrogate was taken (``actor/pg_clipfrac``)."""
    clipfrac_lower: Tensor
    """Fraction of valid tokens capped by the dual clip (``actor/pg_clipfrac_lower``)."""
    approx_kl: Tensor
    """Masked mean of ``old_logprobs - logprobs`` (``actor/ppo_kl``), k1 estimate of
    KL(old || new)."""


def _where_valid(x: Tensor, valid: Tensor) -> Tensor:
    # Replace padding with 0 *before* any arithmetic: garbage (nan/inf) in padding would
    # otherwise reach the gradient through exp / products even if masked afterwards.
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """Clipped surrogate objective of PPO (Schulman et al. 2017) with the dual clip of
    Ye et al. 2020 ("Mastering Complex Control in MOBA Games with Deep RL"); verl
    ``core_algos.compute_policy_loss_vanilla``.

    Per token, with ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``::

        pg = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        pg = min(pg, -A * clip_ratio_c)      if A < 0   (dual clip)
        pg = pg * is_weights                 if given

    then aggregated with :func:`aggregate_loss`. The asymmetric ``low``/``high``
    bounds are DAPO's clip-higher (Yu et al. 2025). The dual clip bounds the loss of a
    negative-advantage token whose ratio has exploded (its gradient is then 0).

    Args:
        logprobs: ``(b, t)`` log-probs of the current policy (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch, as
            recomputed by the trainer (``old_log_prob``).
        advantages: ``(b, t)`` advantages.
        mask: ``(b, t)`` response mask.
        clip_ratio_low: ``epsilon_low``.
        clip_ratio_high: ``epsilon_high``.
        clip_ratio_c: dual-clip constant, must be > 1; ``None`` disables dual clip.
        loss_agg_mode: see :data:`meshrl.algorithms.aggregation.LOSS_AGG_MODES`.
        global_token_count: mini-batch token count for micro-batch accumulation.
        global_seq_count: mini-batch sequence count for micro-batch accumulation.
        norm_length: constant ``T`` of ``seq-mean-token-sum-norm`` (default: this ``t``).
        is_weights: ``(b, t)`` multiplicative per-token weights, e.g.
            :func:`truncated_is_weights`; detached here.

    Returns:
        :class:`PolicyLoss`; the metrics are detached masked means over *this* call's
        tokens (average them over micro-batches for logging).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0, got {clip_ratio_c}")
    valid = valid_positions(mask, logprobs)
    log_ratio = _where_valid(logprobs - old_logprobs, valid).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    adv = _where_valid(advantages, valid)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    clip_taken = clipped > unclipped

    dual_taken = torch.zeros_like(clip_taken)
    if clip_ratio_c is not None:
        dual_cap = -adv * clip_ratio_c
        dual_taken = (adv < 0) & (pg > dual_cap)
        pg = torch.where(dual_taken, dual_cap, pg)

    if is_weights is not None:
        pg = pg * _where_valid(is_weights.detach(), valid)

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
        clipfrac=masked_mean(clip_taken.to(pg.dtype), mask).detach(),
        clipfrac_lower=masked_mean(dual_taken.to(pg.dtype), mask).detach(),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
    )


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    global_seq_count: Tensor | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """GSPO's clipped objective (Zheng et al. 2025, "Group Sequence Policy Optimization";
    verl ``policy_loss.loss_mode=gspo``): the importance ratio of a response is the
    geometric mean of its tokens' ratios, clipped once for the whole response.

    Per response ``i`` (GSPO-token form, which gives every token the gradient of its own
    log-prob scaled by the response's ratio)::

        log s_i   = mean over i's valid tokens of (logprobs - old_logprobs)
        s_i,t     = exp(min(sg[log s_i] + logprobs_t - sg[logprobs_t], 10))   (value: s_i)
        pg_t      = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - low, 1 + high))
        pg_t      = pg_t * is_weights_t                                       if given

    aggregated ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as verl), so that
    each response weighs the same. No dual clip. The paper's clip ranges are tiny (3e-4 and
    4e-4), as a sequence ratio moves far less than a token's.

    Args:
        logprobs: ``(b, t)`` current log-probs (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch.
        advantages: ``(b, t)`` advantages (sequence-level estimators broadcast them).
        mask: ``(b, t)`` response mask; a response is whole within one call.
        clip_ratio_low: ``epsilon_low``.
        clip_ratio_high: ``epsilon_high``.
        global_seq_count: mini-batch response count for micro-batch accumulation.
        is_weights: ``(b, t)`` per-token weights (truncated importance sampling); detached.

    Returns:
        :class:`PolicyLoss`: ``clipfrac`` the fraction of valid tokens where the clipped
        term won (as for PPO), ``clipfrac_lower`` 0, ``approx_kl`` the token-level k1.
    """
    valid = valid_positions(mask, logprobs)
    log_ratio = _where_valid(logprobs - old_logprobs, valid)
    lengths = valid.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio.sum(dim=-1) / lengths).detach()  # (b,)
    own = _where_valid(logprobs, valid)
    ratio = (own - own.detach() + seq_log_ratio.unsqueeze(-1)).clamp(max=10.0).exp()
    adv = _where_valid(advantages, valid)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        pg = pg * _where_valid(is_weights.detach(), valid)

    loss = aggregate_loss(pg, mask, "seq-mean-token-mean", global_seq_count=global_seq_count)
    return PolicyLoss(
        loss=loss,
        clipfrac=masked_mean((clipped > unclipped).to(pg.dtype), mask).detach(),
        clipfrac_lower=torch.zeros((), dtype=pg.dtype, device=pg.device),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
    )


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance-sampling weights ``min(pi_old / pi_rollout, cap)``.

    The rollout engine (vLLM/SGLang, other kernels and precision) samples from a
    slightly different distribution than the trainer's ``pi_old``; reweighting each
    token by the probability ratio, truncated at ``cap`` to bound the variance,
    corrects the bias (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"; verl ``actor_rollout_ref.actor.tis_imp_ratio_cap``).

    Args:
        old_logprobs: ``(b, t)`` trainer log-probs of the sampled tokens.
        rollout_logprobs: ``(b, t)`` log-probs reported by the rollout engine.
        mask: ``(b, t)`` response mask.
        cap: truncation ``C > 0`` (the config value -1 means "off": do not call this).

    Returns:
        ``(b, t)`` detached weights, 0 at masked positions.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    valid = valid_positions(mask, old_logprobs)
    weights = _where_valid(old_logprobs - rollout_logprobs, valid).exp().clamp(max=cap)
    return _where_valid(weights, valid)


@torch.no_grad()
def rollout_mismatch_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor
) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the trainer's.

    Statistics of ``|exp(old_logprobs) - exp(rollout_logprobs)|`` over valid tokens
    (verl ``training/rollout_probs_diff_*``; std is unbiased as ``torch.std``).

    Args:
        old_logprobs: ``(b, t)`` trainer log-probs.
        rollout_logprobs: ``(b, t)`` rollout-engine log-probs.
        mask: ``(b, t)`` response mask.

    Returns:
        ``{"training/rollout_probs_diff_mean"|"_max"|"_std": float}``; 0.0 for an
        empty mask, std 0.0 for a single token.
    """
    valid = valid_positions(mask, old_logprobs)
    diff = (old_logprobs[valid].exp() - rollout_logprobs[valid].exp()).abs().double()
    n = diff.numel()
    return {
        "training/rollout_probs_diff_mean": diff.mean().item() if n else 0.0,
        "training/rollout_probs_diff_max": diff.max().item() if n else 0.0,
        "training/rollout_probs_diff_std": diff.std().item() if n > 1 else 0.0,
    }
