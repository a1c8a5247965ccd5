"""Causal attention over sequences packed back to back in one row (no padding, no mask).

``q`` (T, Hq, D), ``k``/``v`` (T, Hkv, D) hold several sequences one after another;
``cu_seq_lens`` (n + 1,) int32 gives their offsets. Each token attends to the tokens before
it in its own sequence only. The trainer's padding-free micro-batches and the rollout
engine's packed prefill both run through :func:`packed_causal_attention`:

* CUDA, bf16/fp16: Flash Attention varlen, one kernel for the whole row. With autograd,
  through ``torch.nn.attention.varlen.varlen_attn`` (causal is ``window_size=(-1, 0)``);
  it repeats grouped-query keys on torch releases without its ``enable_gqa``. Without
  (a prefill, a log-prob pass), the forward op itself, which takes fewer key heads as they
  are.
* Otherwise (CPU tests, float32): SDPA run sequence by sequence, each causal: exact, slow.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

import torch
from torch.nn import functional as F


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    """(T, Hq, D), (T, Hkv, D), (T, Hkv, D) -> (T, Hq, D); Hq a multiple of Hkv."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if not grad and not _FORWARD_ONLY.get("failed"):
            try:
                return _flash_forward(q, k, v, cu_seq_lens, max_len, scaling)
            except RuntimeError:  # an op signature this torch release does not have
                _FORWARD_ONLY["failed"] = True
        return _flash_varlen(q, k, v, cu_seq_lens, cu_seq_lens, max_len, max_len, scaling)
    return _per_sequence_sdpa(q, k, v, cu_seq_lens, scaling, q.shape[1] != k.shape[1])


_FORWARD_ONLY: dict[str, bool] = {}


def _flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    """The Flash Attention varlen forward op (no autograd): grouped-query heads are native to
    the kernel, so the keys are not repeated (``varlen_attn`` before torch 2.13 needs equal
    head counts)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seq_lens, cu_seq_lens, max_len, max_len, 0.0, True, False, scale=scaling
    )
    return out[0]


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
    kwargs: dict[str, Any] = {}
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
    # Without return_aux it returns the output alone (its annotation: output or a pair).
    return cast(torch.Tensor, varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs))


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
