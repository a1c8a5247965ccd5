"""The element-wise pieces of a decoder layer, optionally fused by ``torch.compile``.

A decode step at a few hundred rows is bound by kernel count, not bytes: Hugging Face's
RMSNorm is seven kernels, rotary embedding five per tensor, the masked softmax five. A
CUDA graph removes launch gaps but not the kernels themselves; compiling these small pure
functions (``dynamic=True``: one compile serves every batch and width) makes each one
kernel. The eager versions are the reference and the fallback (CPU, or a failed compile);
both compute what Hugging Face's modules compute, in the same precision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's Llama/Qwen2 RMSNorm: float32 statistics, weight applied after."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then norm: (x + delta, rms_norm(x + delta))."""
    y = x + delta
    return y, rms_norm(y, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (..., h, d) rotated by cos/sin broadcastable to them (Hugging Face's rotate-half)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def masked_softmax(
    scores: torch.Tensor, scaling: float, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """softmax(scores * scaling + bias) in float32, returned in ``dtype``."""
    return (scores.float() * scaling + bias).softmax(dim=-1).to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * I) -> (..., I): ``silu(gate) * up`` of a fused gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedOps:
    """The functions above, compiled when asked and possible."""

    NAMES = ("rms_norm", "add_rms_norm", "rope", "masked_softmax", "silu_mul", "silu_mul_halves")

    # Set on each instance (eager or compiled), with the signatures of the functions above.
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rope: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]
    masked_softmax: Callable[[torch.Tensor, float, torch.Tensor, torch.dtype], torch.Tensor]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul_halves: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, compile: bool):
        self.compiled = False
        for name in self.NAMES:
            setattr(self, name, globals()[name])
        if compile:
            self._compile()

    def _compile(self) -> None:
        try:
            for name in self.NAMES:
                fn = torch.compile(globals()[name], dynamic=True, fullgraph=True)
                setattr(self, name, fn)
            self.compiled = True
        except Exception as e:  # noqa: BLE001 - no compiler here: stay eager
            log.warning("torch.compile unavailable (%s); decoder ops stay eager", e)
            self.uncompile()

    def uncompile(self) -> None:
        for name in self.NAMES:
            setattr(self, name, globals()[name])
        self.compiled = False
