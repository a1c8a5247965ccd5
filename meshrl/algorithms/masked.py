"""Masked reductions over response tokens.

Every PPO statistic is taken over the *real* response tokens only. A mask is a bool
or float tensor shaped like the values, ``(b, t)`` in practice, where a non-zero entry
marks a real token. Padding may sit anywhere (right padding, or holes such as
tool-observation tokens in multi-turn rollouts).

Two rules hold throughout this package:

* values at masked-out positions are never read: they may be garbage, ``inf`` or
  ``nan`` (e.g. log-probs of pad tokens) without leaking into a result or a gradient;
* a reduction over an empty mask returns 0 rather than ``nan``, so one empty
  micro-batch cannot poison a step.

Semantics follow verl's ``verl.utils.torch_functional`` (``masked_mean``,
``masked_var``, ``masked_whiten``), except for the two rules above.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "safe_div",
    "valid_positions",
    "zero_masked",
]


def valid_positions(mask: Tensor, like: Tensor) -> Tensor:
    """Bool tensor shaped like ``like``: True where ``mask`` is non-zero.

    Args:
        mask: bool/float mask, broadcastable to ``like`` (usually both ``(b, t)``).
        like: the values the mask applies to.
    """
    # .to() is a no-op on the same device; it lets a CPU mask index CUDA values.
    return torch.broadcast_to(mask.to(like.device) != 0, like.shape)


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` with masked-out entries forced to exactly 0.

    Plain ``x * mask`` turns ``nan * 0`` into ``nan``; ``torch.where`` does not, and its
    backward sends a zero gradient to the dropped entries.

    Args:
        x: ``(b, t)`` values.
        mask: ``(b, t)`` bool/float mask; float entries act as weights.

    Returns:
        ``(b, t)`` tensor of ``x``'s dtype.
    """
    weights = mask.to(device=x.device, dtype=x.dtype if x.is_floating_point() else torch.float32)
    return torch.where(
        valid_positions(mask, x), x * weights, torch.zeros((), dtype=x.dtype, device=x.device)
    )


def safe_div(num: Tensor, den: Tensor | float) -> Tensor:
    """``num / den``, with a zero denominator treated as 1.

    Used where ``den`` counts masked entries: an empty mask has ``num == 0`` too, so the
    result is 0. The denominator is replaced *before* dividing, so no ``inf`` ever
    appears in the graph (``torch.where`` after a division would still back-propagate
    ``nan``).
    """
    if not isinstance(den, Tensor):
        # A host number stays on the host: putting it on the GPU would be a copy from
        # pageable memory, which waits for everything queued before it (a sync per loss).
        return num / (den if den != 0 else 1)
    den = den.to(dtype=num.dtype, device=num.device)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all entries when ``dim`` is None).

    Args:
        x: ``(b, t)`` values.
        mask: ``(b, t)`` bool/float mask.
        dim: reduction dim(s); ``dim=-1`` gives per-sequence sums ``(b,)``.

    Returns:
        Scalar, or ``x`` reduced over ``dim``.
    """
    masked = zero_masked(x, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def _mask_count(mask: Tensor, like: Tensor, dim: int | tuple[int, ...] | None) -> Tensor:
    # Broadcast first so a (b, 1) mask counts t entries per row, not one.
    weights = zero_masked(torch.ones_like(like), mask)
    return weights.sum() if dim is None else weights.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries: ``sum(x * mask) / sum(mask)``.

    Args:
        x: ``(b, t)`` values.
        mask: ``(b, t)`` bool/float mask.
        dim: reduction dim(s); ``dim=-1`` gives per-sequence means ``(b,)``.

    Returns:
        Scalar (or reduced tensor); 0 where the mask is empty.
    """
    return safe_div(masked_sum(x, mask, dim), _mask_count(mask, x, dim))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked entries of the batch.

    ``unbiased`` applies Bessel's correction ``n / (n - 1)`` with ``n = sum(mask)``, as
    ``torch.var`` does. verl raises when ``n <= 1``; here the variance is defined as 0
    then, so that whitening a single token yields 0 instead of crashing a step.

    Args:
        x: ``(b, t)`` values.
        mask: ``(b, t)`` bool/float mask.
        unbiased: divide by ``n - 1`` instead of ``n``.

    Returns:
        Scalar tensor.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    n = _mask_count(mask, x, None)
    bessel = n / torch.where(n > 1, n - 1, torch.ones_like(n))
    return torch.where(n > 1, var * bessel, torch.zeros_like(var))


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean, unit variance over all masked entries of the batch.

    ``(x - mean) / sqrt(var + eps)`` with the unbiased masked variance (verl's
    ``masked_whiten``). With ``shift_mean=False`` the mean is added back, i.e. only the
    scale is normalised (used for rewards, whose sign carries meaning).

    Args:
        x: ``(b, t)`` values.
        mask: ``(b, t)`` bool/float mask.
        shift_mean: keep the result centred at 0 (True) or at the original mean.
        eps: added to the variance inside the square root.

    Returns:
        ``(b, t)`` tensor; 0 at masked-out positions (verl leaves garbage there).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(
        valid_positions(mask, x), whitened, torch.zeros((), dtype=whitened.dtype, device=x.device)
    )
