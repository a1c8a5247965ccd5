"""Causal attention over sequences packed into one row, registered with transformers.

A padding-free micro-batch is one ``(1, T)`` row: several prompt+response sequences back to
back, their ``position_ids`` restarting at 0 at each. Attention must stay inside each
sequence. The model's forward carries ``cu_seq_lens_q/k`` (``(n+1,)`` int32 offsets of the
sequences in the row) and ``max_length_q/k`` — the keyword arguments transformers' own
``flash_attention_2`` takes — down to every attention call, so no mask is ever built: the
name registered here has no entry in the mask interface, and transformers' mask
construction then returns ``None`` (``masking_utils._preprocess_mask_arguments``).

The attention itself is :func:`meshrl.packed_attention.packed_causal_attention` (Flash
Attention varlen on CUDA, SDPA sequence by sequence elsewhere).

Without ``cu_seq_lens`` (a plain batch, e.g. right-padded rows) it is plain causal SDPA;
right padding only ever follows the tokens that could see it, so real tokens are exact.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from meshrl.packed_attention import packed_causal_attention

VARLEN_ATTENTION = "meshrl_varlen"
"""The ``attn_implementation`` name of :func:`varlen_attention_forward`."""


# Left out of compiled decoder layers (use_torch_compile): every packed micro-batch has
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
    # Self-attention: padding_free.py passes the same offsets as cu_seq_lens_k (the same
    # tensor; comparing values would sync with the device).
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError("packed self-attention: cu_seq_lens_k must be cu_seq_lens_q")
    assert max_length_q is not None  # transformers passes it with cu_seq_lens_q
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    out = packed_causal_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    return out.unsqueeze(0), None  # (1, T, Hq, D)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
