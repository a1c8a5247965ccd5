"""``silu(gate) * up`` of a fused gate/up projection (Triton, CUDA)."""

from __future__ import annotations

import functools

import torch

from services.rollout.fast.kernels.runtime import cdiv, jit, tl


def _silu_mul_halves_kernel(
    x_ptr,
    out_ptr,
    inter,
    x_stride_row,
    out_stride_row,
    BLOCK: tl.constexpr,
):
    """One (row, column block): out[row, c] = silu(x[row, c]) * x[row, inter + c]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < inter
    src = x_ptr + row * x_stride_row
    gate = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(src + inter + cols, mask=keep, other=0.0).to(tl.float32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride_row + cols, result.to(out_ptr.dtype.element_ty), mask=keep)


@functools.cache
def _kernel():
    return jit(_silu_mul_halves_kernel)


SILU_BLOCK = 1024


def silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2 * I) fused gate/up projection -> (rows, I) ``silu(gate) * up``, in float32
    and rounded once to the input dtype (as the compiled ``fused_ops.silu_mul_halves``).

    A plain 2-D grid of (row, column block). In the same engine profile on the H200 (decode
    at 256 rows plus prefill, 840 calls), the ``torch.compile`` kernel of the same function,
    compiled for dynamic shapes, averaged 39.6 us a call and this one 15.2 us.
    """
    rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, cdiv(inter, SILU_BLOCK))
        _kernel()[grid](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4
        )
    return out
