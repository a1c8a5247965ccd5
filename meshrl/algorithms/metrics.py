"""Logged statistics over response tokens (verl ``trainer.ppo.metric_utils``)."""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_mean, masked_var, valid_positions

__all__ = ["explained_variance", "masked_stats"]


@torch.no_grad()
def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, *, eps: float = 1e-5
) -> Tensor:
    """How much of the returns' variance the critic explains (``critic/vf_explained_var``)::

        EV = 1 - Var[R - V] / (Var[R] + eps)

    1 is a perfect critic, 0 is no better than a constant, < 0 is worse than a
    constant. Variances are unbiased, over valid tokens; ``eps`` as in verl keeps it
    finite when all returns are equal.

    Args:
        values: ``(b, t)`` critic values.
        returns: ``(b, t)`` value targets.
        mask: ``(b, t)`` response mask.

    Returns:
        Scalar tensor.
    """
    valid = valid_positions(mask, values)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    residual = torch.where(valid, returns - values, zero)
    return 1.0 - masked_var(residual, mask) / (masked_var(returns, mask) + eps)


@torch.no_grad()
def masked_stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, float]:
    """Mean, max and min of ``x`` over valid tokens, e.g. ``critic/advantages/mean``.

    Args:
        x: ``(b, t)`` values (advantages, returns, values, ...).
        mask: ``(b, t)`` response mask.
        prefix: metric name prefix, without trailing slash.

    Returns:
        ``{f"{prefix}/mean", f"{prefix}/max", f"{prefix}/min"}`` as floats; all 0.0
        when the mask is empty.
    """
    selected = x[valid_positions(mask, x)]
    if selected.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {
        f"{prefix}/mean": masked_mean(x, mask).item(),
        f"{prefix}/max": selected.max().item(),
        f"{prefix}/min": selected.min().item(),
    }
