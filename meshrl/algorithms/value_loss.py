"""Clipped value-function loss of the PPO critic."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.aggregation import aggregate_loss
from meshrl.algorithms.masked import masked_mean, valid_positions

__all__ = ["ValueLoss", "clipped_value_loss"]


class ValueLoss(NamedTuple):
    """Output of :func:`clipped_value_loss`; both scalars."""

    loss: Tensor
    """Aggregated value loss, with grad (``critic/vf_loss``)."""
    clipfrac: Tensor
    """Fraction of valid tokens where the clipped branch was taken (``critic/vf_clipfrac``)."""


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    cliprange_value: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
) -> ValueLoss:
    """PPO value loss with value clipping (the "PPO2" baselines trick; Engstrom et al.
    2020 "Implementation Matters"; verl ``core_algos.compute_value_loss``)::

        v_clip = clip(v, v_old - c, v_old + c)
        L      = 0.5 * max((v - R)^2, (v_clip - R)^2)

    The max makes it pessimistic: a prediction that moved more than ``c`` from the
    rollout-time value gets no gradient from the clipped branch pulling it further.

    Args:
        values: ``(b, t)`` current critic predictions (with grad).
        old_values: ``(b, t)`` critic values at rollout time (used for the returns).
        returns: ``(b, t)`` regression targets (GAE returns).
        mask: ``(b, t)`` response mask.
        cliprange_value: ``c`` (``critic.cliprange_value``); ``None`` disables clipping.
        loss_agg_mode: see :data:`meshrl.algorithms.aggregation.LOSS_AGG_MODES`.
        global_token_count: mini-batch token count for micro-batch accumulation.
        global_seq_count: mini-batch sequence count for micro-batch accumulation.
        norm_length: constant ``T`` of ``seq-mean-token-sum-norm`` (default: this ``t``).

    Returns:
        :class:`ValueLoss`; ``clipfrac`` is detached, over this call's tokens.
    """
    valid = valid_positions(mask, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # Zero padding before arithmetic so garbage there cannot produce nan gradients.
    v = torch.where(valid, values, zero)
    v_old = torch.where(valid, old_values, zero)
    target = torch.where(valid, returns, zero)

    unclipped = (v - target) ** 2
    if cliprange_value is None:
        loss_mat, clip_taken = unclipped, torch.zeros_like(valid)
    else:
        v_clipped = torch.clamp(v, v_old - cliprange_value, v_old + cliprange_value)
        clipped = (v_clipped - target) ** 2
        loss_mat, clip_taken = torch.maximum(unclipped, clipped), clipped > unclipped

    loss = 0.5 * aggregate_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    return ValueLoss(loss=loss, clipfrac=masked_mean(clip_taken.to(values.dtype), mask).detach())
