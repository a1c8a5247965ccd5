"""Reduce a per-token loss matrix ``(b, t)`` to the scalar that is back-propagated.

The mode decides how tokens and sequences are weighted (verl's ``agg_loss``,
``actor_rollout_ref.actor.loss_agg_mode``):

============================  ====================================================
``token-mean``                ``sum(L * m) / N_tok``  (DAPO, Yu et al. 2025)
``seq-mean-token-sum``        ``sum_i sum_t L_it m_it / N_seq``
``seq-mean-token-mean``       ``sum_i [sum_t L_it m_it / sum_t m_it] / N_seq``  (GRPO)
``seq-mean-token-sum-norm``   ``sum(L * m) / (N_seq * T)``  (Dr. GRPO, Liu et al. 2025)
============================  ====================================================

Why the global counts: a mini-batch is usually split into micro-batches whose
gradients are accumulated. If every micro-batch divides by the *mini-batch's*
token count ``N_tok`` (or sequence count ``N_seq``, or a fixed ``T``), the sum of the
micro-batch losses equals the mini-batch loss exactly, whatever the split. Dividing by
each micro-batch's own count instead would re-weight tokens by the split. Under data
parallelism pass the counts of the whole mini-batch across ranks *and* note that DDP
averages gradients over ranks: multiply the loss by the world size to undo that.

``N_seq`` counts the sequences with at least one valid token: a fully masked row adds
nothing to the sum and is left out of the count too, as in verl 0.9.1's ``agg_loss``
(whose ``seq-mean-token-sum-norm`` is ``N_seq * T`` as well, ``T`` its
``loss_scale_factor``, the response width, unless set; here ``data.max_response_length``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshrl.algorithms.masked import masked_sum, safe_div

__all__ = ["LOSS_AGG_MODES", "aggregate_loss", "sequence_count"]

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def sequence_count(mask: Tensor) -> Tensor:
    """``N_seq`` of ``mask`` ``(b, t)``: the rows with at least one valid token, a 0-d
    tensor."""
    return (mask.sum(dim=-1) > 0).sum()


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_token_count: Tensor | float | None = None,
    global_seq_count: Tensor | float | None = None,
    norm_length: Tensor | float | None = None,
) -> Tensor:
    """Aggregate a per-token loss into a scalar.

    Args:
        loss_mat: ``(b, t)`` per-token loss; values at masked positions are ignored.
        mask: ``(b, t)`` bool/float response mask.
        mode: one of :data:`LOSS_AGG_MODES`.
        global_token_count: ``N_tok`` for ``token-mean``; default ``mask.sum()`` of this
            call (pass the mini-batch's count when accumulating micro-batches).
        global_seq_count: ``N_seq`` for the ``seq-mean-*`` modes; default
            :func:`sequence_count` of this call: the rows with a valid token (verl leaves
            fully masked rows out too).
        norm_length: ``T`` for ``seq-mean-token-sum-norm``; default ``t`` of this call.
            Pass a constant (e.g. the max response length) when micro-batches are
            padded to different lengths, otherwise they are normalised differently.

    Returns:
        Scalar tensor; 0 when the mask is empty.

    Raises:
        ValueError: unknown ``mode`` or ``loss_mat`` not 2-D.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (b, t), got shape {tuple(loss_mat.shape)}")

    if mode == "token-mean":
        n_tok = global_token_count
        if n_tok is None:
            n_tok = masked_sum(torch.ones_like(loss_mat), mask)
        return safe_div(masked_sum(loss_mat, mask), n_tok)

    n_seq = sequence_count(mask) if global_seq_count is None else global_seq_count
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (b,)
    if mode == "seq-mean-token-sum":
        return safe_div(seq_sums.sum(), n_seq)
    if mode == "seq-mean-token-mean":
        seq_lengths = masked_sum(torch.ones_like(loss_mat), mask, dim=-1)
        return safe_div(safe_div(seq_sums, seq_lengths).sum(), n_seq)
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    return safe_div(seq_sums.sum(), n_seq * length)
