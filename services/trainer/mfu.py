"""Model FLOPs utilisation of an update: the FLOPs the model needs over the time it took
(and, beside it, the update's peak GPU memory).

Counted FLOPs (forward + backward = 3x forward), per sequence of s tokens:

    6 * N * s                dense matmuls (N: parameters that multiply, the LM head
                             included, the input embedding lookup not, unless tied;
                             a frozen one, LoRA's base weights, counts 4/6: no weight grad)
    6 * L * d_attn * s^2     causal attention (QK^T and PV: 2 * 2 * s^2/2 * d_attn forward)

Recomputation (gradient checkpointing, chunked LM head) is not counted: MFU counts the
model's FLOPs, not the hardware's. Peak: the H100/H200 dense bf16 rate, 989 TFLOP/s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol, cast

import torch
from torch import nn

from services.trainer.model_loading import decoder_config

PEAK_BF16_FLOPS = 989e12


class _HasInputEmbeddings(Protocol):
    def get_input_embeddings(self) -> nn.Module: ...


def matmul_params(model: nn.Module, frozen_only: bool = False) -> int:
    """Parameters that take part in matmuls: all but an untied input embedding (with
    ``frozen_only``, those of them that are not trained)."""
    # A causal LM, or the decoder a ValueModel wraps (nn.Module types it Tensor | Module).
    inner = cast(
        "_HasInputEmbeddings | None",
        model if hasattr(model, "get_input_embeddings") else getattr(model, "model", None),
    )
    embed = inner.get_input_embeddings() if inner is not None else None
    head = getattr(model, "lm_head", None)
    lookup_only = (
        embed.weight
        if embed is not None and (head is None or head.weight is not embed.weight)
        else None
    )
    return sum(
        p.numel()
        for p in model.parameters()
        if p is not lookup_only and not (frozen_only and p.requires_grad)
    )


def weighted_matmul_params(model: nn.Module) -> float:
    """Matmul parameters weighted for :func:`training_flops`: a frozen weight (LoRA's base)
    costs 4 FLOPs a token, not 6: its backward computes the input's gradient only."""
    return matmul_params(model) - matmul_params(model, frozen_only=True) / 3


def training_flops(n_params: float, layers: int, attn_dim: int, seq_lens: Iterable[int]) -> float:
    """FLOPs of one forward + backward over sequences of the given lengths."""
    lens = [int(s) for s in seq_lens]
    return 6.0 * n_params * sum(lens) + 6.0 * layers * attn_dim * sum(s * s for s in lens)


def model_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, attention width = heads * head_dim) from a Hugging Face config."""
    cfg = decoder_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_attention_heads * head_dim


class UpdateTimer:
    """Wall time of an update, synchronised with the device at both ends; on a GPU it also
    starts the peak-memory counters afresh, so :func:`peak_memory_metrics` reads the
    update's own peak (not a log-prob pass's before it)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> UpdateTimer:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def peak_memory_metrics(role: str, device: torch.device) -> dict[str, float]:
    """``perf/max_memory_allocated_gb/{role}`` (tensors) and ``perf/max_memory_reserved_gb/{role}``
    (the caching allocator's segments) of this process's GPU since the update began, in
    GiB, as verl's ``perf/max_memory_*_gb``; nothing off a GPU. On one rank per role
    process, so co-located roles each report their own."""
    if device.type != "cuda":
        return {}
    gib = 1024**3
    return {
        f"perf/max_memory_allocated_gb/{role}": torch.cuda.max_memory_allocated(device) / gib,
        f"perf/max_memory_reserved_gb/{role}": torch.cuda.max_memory_reserved(device) / gib,
    }


def perf_metrics(
    role: str,
    model: nn.Module,
    seq_lens: list[int],
    epochs: int,
    seconds: float,
    world_size: int,
    n_params: float | None = None,
) -> dict[str, float]:
    """``perf/mfu/{role}`` and ``perf/throughput/{role}`` (tokens/s per GPU) of an update."""
    layers, attn_dim = model_shape(model)
    n = n_params if n_params is not None else weighted_matmul_params(model)
    flops = epochs * training_flops(n, layers, attn_dim, seq_lens)
    tokens = epochs * sum(seq_lens)
    seconds = max(seconds, 1e-9)
    return {
        f"perf/mfu/{role}": flops / seconds / (PEAK_BF16_FLOPS * world_size),
        f"perf/throughput/{role}": tokens / seconds / world_size,
    }
