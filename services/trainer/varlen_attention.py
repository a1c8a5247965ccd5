"""Causal attention over sequences packed into one row, registered with transformers.

A padding-free micro-batch is one ``(1, T)`` row: several prompt+response sequences back to
back, their ``position_ids`` restarting at 0 at each. Attention must stay inside each
sequence. The model's forward carries ``cu_seq_lens_q/k`` (``(n+1,)`` int32 offsets of the
sequences in the row) and ``max_length_q/k`` — the keyword arguments transformers' own
``flash_attention_2`` takes — down to every attention call, so no mask is ever built: the
name registered here has no entry in the mask interface, and transformers' mask
construction then returns ``None`` (``masking_utils._preprocess_mask_arguments``).

* CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention varlen;
  causal is ``window_size=(-1, 0)``), one kernel for the whole row.
* Otherwise (CPU tests, float32): SDPA run sequence by sequence, each causal: exact, slow.

Without ``cu_seq_lens`` (a plain batch, e.g. right-padded rows) it is plain causal SDPA;
right padding only ever follows the tokens that could see it, so real tokens are exact.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN_ATTENTION = "meshrl_varlen"
"""The ``attn_implementation`` name of :func:`varlen_attention_forward`."""


# Left out of compiled decoder layers (MESHRL_COMPILE_LAYERS): every packed micro-batch has
# its own sequence count and longest length, which compiled code would specialise on and
# recompile for (up to dynamo's limit, then fall back). The attention is one kernel either
# way; the element-wise work around it still compiles.
@torch.compiler.disable
def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D), as transformers'
    attention functions take and return them."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed sequences are one row, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("varlen attention has no dropout (the trainer never uses it)")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        max_k = max_length_k if max_length_k is not None else max_length_q
        out = _flash_varlen(q, k, v, cu_seq_lens_q, cu_k, int(max_length_q), int(max_k), scaling)
    else:
        out = _per_sequence_sdpa(q, k, v, cu_seq_lens_q, scaling, q.shape[1] != k.shape[1])
    return out.unsqueeze(0), None  # (1, T, Hq, D)


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """(T, H, D) each -> (T, Hq, D) through ``varlen_attn``. Its keywords changed across
    torch releases (2.13: ``window_size=(-1, 0)`` for causal, ``scale``, ``enable_gqa``;
    earlier: ``is_causal``), so they are picked from its signature."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if scaling is not None and "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None:  # the kernel's scale is 1/sqrt(D): fold the difference into q
        q = q * (scaling * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _per_sequence_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """(T, H, D) each -> (T, Hq, D): causal SDPA on each sequence alone."""
    bounds = cu_seq_lens.tolist()  # a host sync: fine off the fast path
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (H, L, D)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        parts.append(out.transpose(0, 1))  # (L, Hq, D)
    return torch.cat(parts)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
