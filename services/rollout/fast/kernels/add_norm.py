"""Residual add and RMSNorm of a split-K projection's partial sums (Triton, CUDA).

A decode step's o_proj and down_proj at a few hundred rows make few output tiles: each
program walks all of K (896 for o_proj) one block after another, and the projection takes
several times its bandwidth floor. Split over K they make several times the programs, each
with a short walk, but the float32 partials then need summing. The norm after the
projection reads its output anyway, so here it sums the partials where it loads them: the
split costs no reduction kernel of its own.

:func:`add_rms_norm_partials` computes what ``fused_ops.add_rms_norm(x, delta, w, eps)``
computes with ``delta`` the projection's output rounded to x's dtype (the partials summed
in split order, in float32, then rounded once, as :func:`kernels.linear`'s reduction does).
"""

from __future__ import annotations

import functools

import torch

from services.rollout.fast.fused_ops import add_rms_norm
from services.rollout.fast.kernels.runtime import jit, tl, triton


def _add_rms_norm_partials_kernel(
    x_ptr,
    x_stride_row,
    parts_ptr,
    parts_stride_split,
    parts_stride_row,
    bias_ptr,
    weight_ptr,
    y_ptr,
    y_stride_row,
    h_ptr,
    h_stride_row,
    width,
    eps,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: delta = round(sum of the SPLITS partials (+ bias)); y = round(x + delta);
    h = weight * round(y * rsqrt(mean(y^2) + eps)), with the torch path's roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < width
    dtype = y_ptr.dtype.element_ty
    src = parts_ptr + row * parts_stride_row + cols
    delta = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        delta += tl.load(src + split * parts_stride_split, mask=keep, other=0.0)
    if HAS_BIAS:
        delta += tl.load(bias_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    delta = delta.to(dtype).to(tl.float32)
    x = tl.load(x_ptr + row * x_stride_row + cols, mask=keep, other=0.0).to(tl.float32)
    y = (x + delta).to(dtype)
    tl.store(y_ptr + row * y_stride_row + cols, y, mask=keep)
    y = y.to(tl.float32)
    inv = tl.rsqrt(tl.sum(y * y, axis=0) / width + eps)
    normed = (y * inv).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * h_stride_row + cols, (w * normed).to(dtype), mask=keep)


@functools.cache
def _kernel():
    return jit(_add_rms_norm_partials_kernel)


def add_rms_norm_partials(
    x: torch.Tensor,
    parts: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): y = x + delta, h = RMSNorm(y) * weight, where delta is the float32 partials
    ``parts`` (splits, rows, width) summed in split order, plus ``bias``, rounded to x's
    dtype. x (rows, width), unit column stride; weight and bias (width,) contiguous."""
    rows, width = x.shape
    splits = parts.shape[0]
    assert parts.shape == (splits, rows, width) and parts.dtype == torch.float32
    assert parts.stride(2) == 1 and x.stride(1) == 1 and weight.stride(0) == 1
    if bias is not None:
        assert bias.shape == (width,) and bias.stride(0) == 1
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(y)
    if rows:
        block = triton.next_power_of_2(width)
        _kernel()[(rows,)](
            x, x.stride(0), parts, parts.stride(0), parts.stride(1),
            bias if bias is not None else weight, weight, y, y.stride(0), h, h.stride(0),
            width, eps, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return y, h


def add_rms_norm_partials_reference(x, parts, weight, eps, bias=None):
    """The torch path: the partials summed in split order and rounded (the projection's
    output), then ``fused_ops.add_rms_norm``."""
    delta = parts[0].clone()
    for split in range(1, parts.shape[0]):
        delta += parts[split]
    if bias is not None:
        delta += bias.float()
    return add_rms_norm(x, delta.to(x.dtype), weight, eps)
