"""PPO clipped policy-gradient loss with dual clip, GSPO's and GMPO's sequence-level
variants, Clip-Cov and KL-Cov (which hold back the tokens whose covariance drives the
entropy down), and truncated importance sampling for the rollout-engine / trainer log-prob
mismatch.

Sign convention: the loss is *minimised*; a positive advantage lowers the loss when
the token's probability rises.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.aggregation import aggregate_loss, sequence_count
from meshrl.algorithms.masked import masked_mean, safe_div, valid_positions

__all__ = [
    "PolicyLoss",
    "clip_cov_policy_loss",
    "geo_mean_policy_loss",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "ppo_policy_loss",
    "rollout_mismatch_metrics",
    "truncated_is_weights",
]


class PolicyLoss(NamedTuple):
    """Output of :func:`ppo_policy_loss` and the other policy losses; all scalars. The
    other losses' docstrings say where a field counts something else."""

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


def _token_log_ratios(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(valid, log_ratio, advantages), each ``(b, t)``: the positions to read, log(pi/pi_old)
    clamped at +-20 (a ratio past e^20 is an overflow, not a signal) and the advantages,
    both zero outside ``valid`` so that garbage under padding never reaches a gradient."""
    valid = valid_positions(mask, logprobs)
    log_ratio = _where_valid(logprobs - old_logprobs, valid).clamp(-20.0, 20.0)
    return valid, log_ratio, _where_valid(advantages, valid)


def _surrogates(
    adv: Tensor, ratio: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's two per-token losses ``(b, t)``: -A r and -A clip(r, 1 - low, 1 + high)."""
    return -adv * ratio, -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)


def _token_loss(
    pg: Tensor,
    mask: Tensor,
    valid: Tensor,
    is_weights: Tensor | None,
    loss_agg_mode: str,
    **counts: Tensor | float | None,
) -> Tensor:
    """The scalar loss of per-token terms ``pg`` ``(b, t)``: each times its importance
    weight (``is_weights`` ``(b, t)``, detached; none: 1), aggregated over ``mask`` by
    ``loss_agg_mode`` with ``counts`` (``global_token_count``, ``global_seq_count``,
    ``norm_length``) as :func:`aggregate_loss` takes them."""
    if is_weights is not None:
        pg = pg * _where_valid(is_weights.detach(), valid)
    return aggregate_loss(pg, mask, loss_agg_mode, **counts)


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
    valid, log_ratio, adv = _token_log_ratios(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    unclipped, clipped = _surrogates(adv, ratio, clip_ratio_low, clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    clip_taken = clipped > unclipped

    dual_taken = torch.zeros_like(clip_taken)
    if clip_ratio_c is not None:
        dual_cap = -adv * clip_ratio_c
        dual_taken = (adv < 0) & (pg > dual_cap)
        pg = torch.where(dual_taken, dual_cap, pg)

    loss = _token_loss(
        pg,
        mask,
        valid,
        is_weights,
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
    unclipped, clipped = _surrogates(adv, ratio, clip_ratio_low, clip_ratio_high)
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


def geo_mean_policy_loss(
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
    """GMPO's objective (Zhao et al. 2025, "Geometric-Mean Policy Optimization"; verl
    ``policy_loss.loss_mode=geo_mean``): a response's ratio is the geometric mean of its
    token ratios, each clipped first, in log space, on the side PPO would clip it.

    Per response ``i``, with ``log r_t = clamp(logprobs_t - old_logprobs_t, -20, 20)``::

        l_t  = min(log r_t, high)    if A_t > 0      (a gain is capped)
             = max(log r_t, -low)    if A_t < 0      (a loss is capped)
             = 0                     if A_t = 0
        s_i  = exp(mean over i's valid tokens of l_t)
        A_i  = mean over i's valid tokens of A_t
        w_i  = exp(mean over i's valid tokens of log(is_weights_t + 1e-10))   (1 if not given)
        pg_i = -A_i * s_i * w_i

    and the loss is ``sum_i pg_i / N_seq`` whatever ``loss_agg_mode`` says (as verl). The
    bounds hold ``log r``, i.e. ``r`` in ``[exp(-low), exp(high)]``: a geometric mean moves
    less than its largest factor, so the paper widens the range to ``low = high = 0.4``. A
    token's gradient is ``-A_i * s_i * w_i / |y_i|`` where its own log-ratio was kept, 0
    where a bound replaced it. The objective is defined for one advantage a response
    (outcome estimators); token-level advantages (GAE) enter through their mean and their
    per-token sign, as in verl.

    Args:
        logprobs: ``(b, t)`` current log-probs (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch.
        advantages: ``(b, t)`` advantages.
        mask: ``(b, t)`` response mask; a response is whole within one call.
        clip_ratio_low: ``epsilon_low``, a bound on ``-log r``.
        clip_ratio_high: ``epsilon_high``, a bound on ``log r``.
        global_seq_count: mini-batch response count for micro-batch accumulation.
        is_weights: ``(b, t)`` per-token weights (truncated importance sampling), merged
            into one weight a response by their geometric mean; detached.

    Returns:
        :class:`PolicyLoss`: ``clipfrac`` the fraction of valid tokens with ``A > 0`` whose
        log-ratio was capped at ``high``, ``clipfrac_lower`` of those with ``A < 0`` capped
        at ``-low``; ``approx_kl`` the token-level k1 as for PPO.
    """
    valid, log_ratio, adv = _token_log_ratios(logprobs, old_logprobs, advantages, mask)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    # The pessimistic side of PPO's min, taken per token on the log-ratio. A = 0 (and
    # padding, where A was set to 0) adds log 1 but still counts in the response's length.
    bounded = torch.where(
        adv > 0,
        log_ratio.clamp(max=clip_ratio_high),
        torch.where(adv < 0, log_ratio.clamp(min=-clip_ratio_low), zero),
    )
    lengths = valid.sum(dim=-1).clamp(min=1)
    seq_ratio = (bounded.sum(dim=-1) / lengths).exp()  # (b,)
    pg = -(adv.sum(dim=-1) / lengths) * seq_ratio  # (b,)
    if is_weights is not None:
        log_w = _where_valid((is_weights.detach() + 1e-10).log(), valid)
        pg = pg * (log_w.sum(dim=-1) / lengths).exp()

    n_seq = sequence_count(valid) if global_seq_count is None else global_seq_count
    capped_high = (adv > 0) & (log_ratio > clip_ratio_high)
    capped_low = (adv < 0) & (log_ratio < -clip_ratio_low)
    return PolicyLoss(
        loss=safe_div(pg.sum(), n_seq),
        clipfrac=masked_mean(capped_high.to(pg.dtype), mask).detach(),
        clipfrac_lower=masked_mean(capped_low.to(pg.dtype), mask).detach(),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
    )


def _token_covariance(logprobs: Tensor, advantages: Tensor, valid: Tensor) -> Tensor:
    # Each token's term of the covariance of log-prob and advantage, centred over this
    # call's valid tokens: by Cui et al. 2025 the sum of these terms is how fast a policy-
    # gradient step lowers the entropy. Detached: it only chooses tokens. (b, t), 0 at padding.
    logp = _where_valid(logprobs.detach(), valid)
    adv = _where_valid(advantages, valid)
    cov = (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))
    return _where_valid(cov, valid)


def _fraction_count(valid: Tensor, fraction: float) -> Tensor:
    # max(1, int(fraction * valid tokens)) as verl, kept on the device: no host sync. In
    # float64, so that the product rounds as Python's does.
    return (valid.sum().double() * fraction).floor().clamp(min=1).long()


def _largest(keys: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    # Bool like `keys`: the k largest keys among the eligible entries (all of them when
    # fewer), ties to the first in row-major order. Ranks from a sort rather than topk, so
    # that k may stay a device tensor.
    ranked = torch.where(eligible, keys, torch.full_like(keys, -math.inf)).flatten()
    order = torch.argsort(ranked, descending=True, stable=True)
    rank = torch.argsort(order).view_as(keys)  # each entry's place in that order
    return eligible & (rank < k)


def clip_cov_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
    is_weights: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PolicyLoss:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models"; verl ``policy_loss.loss_mode=clip_cov``): PPO's clipped
    surrogate with a few random high-covariance tokens taken out of the loss.

    Rewarded tokens the policy is already sure of are what drives its entropy down; holding
    a small random share of them back slows the collapse. Per token, with
    ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``::

        cov_t = (A_t - mean A) * (logprobs_t - mean logprobs)   (means over this call's tokens)
        pg_t  = max(-A_t * r_t, -A_t * clip(r_t, 1 - low, 1 + high))
        candidates: clip_cov_lb < cov_t < clip_cov_ub, where PPO's clip was not taken
        n     = max(1, floor(clip_cov_ratio * this call's valid tokens))
        pg_t  = 0 for n candidates drawn uniformly (all of them if fewer)
        pg_t  = pg_t * is_weights_t                                  if given

    then aggregated with :func:`aggregate_loss`. A drawn token has no loss and no gradient
    but still counts in the aggregation's denominators. No dual clip (as verl).

    The centring, the count ``n`` and the draw are over this call's tokens: with micro-
    batches the selection is per micro-batch (as verl), so the split changes which tokens
    are held back, and micro-batch losses need not sum to the mini-batch's.

    Args:
        logprobs: ``(b, t)`` current log-probs (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch.
        advantages: ``(b, t)`` advantages.
        mask: ``(b, t)`` response mask.
        clip_ratio_low: ``epsilon_low``.
        clip_ratio_high: ``epsilon_high``.
        clip_cov_ratio: share of the valid tokens held back at most, > 0.
        clip_cov_lb: candidates' covariance lies above this.
        clip_cov_ub: and below this.
        loss_agg_mode: see :data:`meshrl.algorithms.aggregation.LOSS_AGG_MODES`.
        global_token_count: mini-batch token count for micro-batch accumulation.
        global_seq_count: mini-batch sequence count for micro-batch accumulation.
        norm_length: constant ``T`` of ``seq-mean-token-sum-norm`` (default: this ``t``).
        is_weights: ``(b, t)`` per-token weights (truncated importance sampling); detached.
        generator: of the draw, on ``logprobs``' device; None draws from torch's global
            generator (as verl).

    Returns:
        :class:`PolicyLoss`: ``clipfrac`` the fraction of valid tokens held back (verl's
        ``pg_clipfrac`` of this mode; PPO's own clipping is not reported), ``clipfrac_lower``
        0, ``approx_kl`` the token-level k1 as for PPO.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    valid, log_ratio, adv = _token_log_ratios(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    unclipped, clipped = _surrogates(adv, ratio, clip_ratio_low, clip_ratio_high)
    cov = _token_covariance(logprobs, adv, valid)
    candidates = valid & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    # A uniform draw of n candidates: the n largest of independent uniform keys.
    keys = torch.rand(cov.shape, generator=generator, dtype=cov.dtype, device=cov.device)
    held_back = _largest(keys, candidates, _fraction_count(valid, clip_cov_ratio))
    pg = torch.maximum(unclipped, clipped)
    pg = torch.where(held_back, torch.zeros((), dtype=pg.dtype, device=pg.device), pg)
    loss = _token_loss(
        pg,
        mask,
        valid,
        is_weights,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    return PolicyLoss(
        loss=loss,
        clipfrac=masked_mean(held_back.to(pg.dtype), mask).detach(),
        clipfrac_lower=torch.zeros((), dtype=pg.dtype, device=pg.device),
        approx_kl=masked_mean(-log_ratio, mask).detach(),
    )


def kl_cov_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    loss_agg_mode: str = "token-mean",
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models"; verl ``policy_loss.loss_mode=kl_cov``): the importance-
    weighted policy gradient, unclipped, with a penalty on the log-ratio of the tokens of
    largest covariance between log-prob and advantage.

    Those tokens are what drives the entropy down; the penalty keeps them near the old
    policy instead of clipping everyone. Per token, with
    ``log r = clamp(logprobs - old_logprobs, -20, 20)``::

        cov_t = (A_t - mean A) * (logprobs_t - mean logprobs)   (means over this call's tokens)
        pg_t  = -A_t * r_t
        pg_t  = pg_t + ppo_kl_coef * |log r_t|   for the max(1, floor(kl_cov_ratio * valid
                                                 tokens)) tokens of largest cov_t
        pg_t  = pg_t * is_weights_t              if given

    then aggregated with :func:`aggregate_loss`; ties in ``cov`` go to the first token in
    row-major order. No clip at all, as verl and the paper: the penalty is the only brake.

    The centring and the count are over this call's tokens: with micro-batches the top
    tokens are chosen per micro-batch (as verl), so micro-batch losses sum to the
    mini-batch's only where the choice cannot differ (``kl_cov_ratio = 1``, or at ratio 1
    where the penalty and its gradient vanish).

    Args:
        logprobs: ``(b, t)`` current log-probs (with grad).
        old_logprobs: ``(b, t)`` log-probs of the policy that generated the batch.
        advantages: ``(b, t)`` advantages.
        mask: ``(b, t)`` response mask.
        kl_cov_ratio: share of the valid tokens penalised, > 0.
        ppo_kl_coef: weight of the penalty.
        loss_agg_mode: see :data:`meshrl.algorithms.aggregation.LOSS_AGG_MODES`.
        global_token_count: mini-batch token count for micro-batch accumulation.
        global_seq_count: mini-batch sequence count for micro-batch accumulation.
        norm_length: constant ``T`` of ``seq-mean-token-sum-norm`` (default: this ``t``).
        is_weights: ``(b, t)`` per-token weights (truncated importance sampling); detached.

    Returns:
        :class:`PolicyLoss`: ``clipfrac`` and ``clipfrac_lower`` 0; ``approx_kl`` the
        masked mean of ``|logprobs - old_logprobs|`` (verl's ``ppo_kl`` of this mode).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid, log_ratio, adv = _token_log_ratios(logprobs, old_logprobs, advantages, mask)

    cov = _token_covariance(logprobs, adv, valid)
    penalised = _largest(cov, valid, _fraction_count(valid, kl_cov_ratio))
    pg = -adv * log_ratio.exp()
    pg = torch.where(penalised, pg + ppo_kl_coef * log_ratio.abs(), pg)
    loss = _token_loss(
        pg,
        mask,
        valid,
        is_weights,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    zero = torch.zeros((), dtype=pg.dtype, device=pg.device)
    return PolicyLoss(
        loss=loss,
        clipfrac=zero,
        clipfrac_lower=zero,
        approx_kl=masked_mean(log_ratio.abs(), mask).detach(),
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
