"""Token log-probabilities and entropies from logits, without materialising a full
``(b, t, V)`` log-softmax.

For ``float16``/``bfloat16`` logits the vocabulary reductions run in ``float32``,
chunk by chunk of rows, so the float32 copy is at most ``chunk_rows x V`` at a time
(bf16 keeps 8 mantissa bits: near 20 its spacing is 0.125, so ``logit - logsumexp``
would round a log-prob like -0.01 to 0 or -0.125). The result is then float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["entropy_from_logits", "logprobs_from_logits"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_DEFAULT_CHUNK_ROWS = 1024


def _by_row_chunks(
    fn: Callable[..., Tensor], logits: Tensor, chunk_rows: int, labels: Tensor | None = None
) -> Tensor:
    # fn maps (n, V) float32 logits [and (n,) labels] to (n,); rows are independent.
    chunks = logits.reshape(-1, logits.shape[-1]).split(chunk_rows)
    if labels is None:
        pieces = [fn(rows.float()) for rows in chunks]
    else:
        label_chunks = labels.reshape(-1).split(chunk_rows)
        pieces = [fn(rows.float(), ys) for rows, ys in zip(chunks, label_chunks, strict=True)]
    out = torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])


def _gather_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    # log softmax(z)[y] = z[y] - logsumexp(z): one (..., V) reduction, no (..., V) output.
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor) -> Tensor:
    probs = torch.softmax(logits, dim=-1)
    # -inf logits (banned tokens) have p = 0; 0 * -inf would be nan, 0 * finite is 0.
    finite = logits.clamp(min=torch.finfo(logits.dtype).min)
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, *, chunk_rows: int = _DEFAULT_CHUNK_ROWS
) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``.

    Args:
        logits: ``(..., V)``, e.g. ``(b, t, V)`` (already shifted so that position
            ``t`` predicts ``labels[..., t]``).
        labels: ``(...)`` int64 token ids.
        chunk_rows: rows per float32 chunk for fp16/bf16 logits.

    Returns:
        ``(...)`` log-probs, differentiable w.r.t. ``logits``; float32 for fp16/bf16
        input, else ``logits.dtype``.
    """
    if logits.dtype in _LOW_PRECISION:
        return _by_row_chunks(_gather_logprobs, logits, chunk_rows, labels)
    return _gather_logprobs(logits, labels)


def entropy_from_logits(logits: Tensor, *, chunk_rows: int = _DEFAULT_CHUNK_ROWS) -> Tensor:
    """Entropy ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` of each categorical.

    Numerically stable for large logits (no ``exp`` of raw logits) and for ``-inf``
    logits (masked vocabulary). Feeds ``actor/entropy`` and the entropy bonus
    (``actor_rollout_ref.actor.entropy_coeff``); verl ``torch_functional.entropy_from_logits``.

    Args:
        logits: ``(..., V)``.
        chunk_rows: rows per float32 chunk for fp16/bf16 logits.

    Returns:
        ``(...)`` entropies in nats, differentiable; float32 for fp16/bf16 input.
    """
    if logits.dtype in _LOW_PRECISION:
        return _by_row_chunks(_entropy, logits, chunk_rows)
    return _entropy(logits)
