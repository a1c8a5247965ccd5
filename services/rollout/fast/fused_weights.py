"""One GEMM for q/k/v and one for gate/up: the projections' weights moved into one buffer.

At decode batch sizes each GEMM is a few microseconds and the k and v projections are
narrow (2 heads x 64 for Qwen2.5-0.5B), so seven launches per layer cost more than their
bytes. Concatenating q/k/v (and gate/up) along the output dimension makes them two.

The fused buffer is the *only* copy: the Hugging Face modules' parameters are re-made as
views into it, so everything that writes weights by name (``load_weights``, a weight sync)
writes the fused buffer in place, and the model's own forward (scoring, the plain engine)
still reads the same numbers. Names and shapes of ``named_parameters()`` are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's fused projections."""

    qkv_weight: torch.Tensor  # (q_out + 2 * kv_out, hidden): rows q, then k, then v
    qkv_bias: torch.Tensor | None  # (q_out + 2 * kv_out,) when the projections have biases
    q_out: int  # num_heads * head_dim
    kv_out: int  # kv_heads * head_dim
    gate_up_weight: torch.Tensor | None  # (2 * intermediate, hidden): gate rows, then up
    intermediate: int


class DecoderLayerLike(Protocol):
    """What :func:`fuse_layer` reads of a Hugging Face decoder layer (any nn.Module
    passes: its attributes are typed loosely)."""

    @property
    def self_attn(self) -> Any: ...

    @property
    def mlp(self) -> Any: ...


def _fuse_rows(linears: list[nn.Linear], attr: str) -> torch.Tensor:
    """Concatenates ``attr`` ("weight" or "bias") of the linears along dim 0 and re-points
    each module's parameter at its rows of the result; returns the result."""
    parts = [getattr(lin, attr) for lin in linears]
    fused = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for lin, part in zip(linears, parts, strict=True):
        rows = part.shape[0]
        # Parameter() aliases the view's storage: a copy_ into it lands in `fused`.
        setattr(lin, attr, nn.Parameter(fused[start : start + rows], requires_grad=False))
        start += rows
    return fused


def can_fuse(layer: object) -> bool:
    """Whether the layer has the plain Llama/Qwen projections this fusion expects."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj")
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names):
        return False
    if mlp is None:
        return False
    biases = [getattr(attn, n).bias is not None for n in names]
    return all(biases) or not any(biases)


@torch.no_grad()
def fuse_layer(layer: DecoderLayerLike) -> FusedLayer:
    """Fuses one layer's q/k/v (and gate/up, when the MLP has them, without biases)."""
    if not can_fuse(layer):
        raise ValueError(f"{type(layer).__name__}: no plain q/k/v projections to fuse")
    attn: Any = layer.self_attn  # a Hugging Face attention module
    mlp = layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    weight = _fuse_rows(qkv, "weight")
    bias = _fuse_rows(qkv, "bias") if attn.q_proj.bias is not None else None
    gate_up, intermediate = None, 0
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if (
        isinstance(gate, nn.Linear)
        and isinstance(up, nn.Linear)
        and gate.bias is None
        and up.bias is None
    ):
        gate_up = _fuse_rows([gate, up], "weight")
        intermediate = gate.out_features
    return FusedLayer(
        qkv_weight=weight,
        qkv_bias=bias,
        q_out=attn.q_proj.out_features,
        kv_out=attn.k_proj.out_features,
        gate_up_weight=gate_up,
        intermediate=intermediate,
    )
