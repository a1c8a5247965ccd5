"""Per-group statistics of sequence scores, for group-relative baselines (GRPO, RLOO,
REINFORCE++-baseline).

A group is the set of responses sampled for one prompt (``actor_rollout_ref.rollout.n``
of them). Group membership is given per sequence by ``group_ids`` ``(b,)``; members
need not be contiguous in the batch and ids need not be dense.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["GroupStats", "group_stats"]


class GroupStats(NamedTuple):
    """Statistics of each sequence's group, gathered back per sequence, all ``(b,)``."""

    mean: Tensor
    """Mean score of the group."""
    std: Tensor
    """Unbiased std (``torch.std``) of the group's scores; 0 for a singleton."""
    size: Tensor
    """Number of sequences in the group (int64)."""


def _dense_group_index(group_ids: Tensor | Sequence[Hashable], device: torch.device) -> Tensor:
    # verl groups by uid strings; accept those too and map them to dense ints.
    if isinstance(group_ids, Tensor):
        ids = group_ids.to(device)
    else:
        lookup: dict[Hashable, int] = {}
        ids = torch.tensor([lookup.setdefault(g, len(lookup)) for g in group_ids], device=device)
    _, index = torch.unique(ids.reshape(-1), return_inverse=True)
    return index


def group_stats(scores: Tensor, group_ids: Tensor | Sequence[Hashable]) -> GroupStats:
    """Mean, unbiased std and size of each sequence's group.

    Computed with ``index_add_`` (no Python loop over groups), two-pass for the std so
    that large, nearly equal scores do not cancel catastrophically.

    Args:
        scores: ``(b,)`` float sequence scores.
        group_ids: ``(b,)`` group of each sequence: an int tensor, or any sequence of
            hashables (e.g. uid strings).

    Returns:
        :class:`GroupStats` with ``(b,)`` fields.
    """
    if scores.dim() != 1 or len(group_ids) != scores.shape[0]:
        raise ValueError(
            f"scores must be (b,) and group_ids (b,); got {tuple(scores.shape)} and {len(group_ids)}"
        )
    index = _dense_group_index(group_ids, scores.device)
    n_groups = int(index.max()) + 1 if index.numel() else 0

    def per_group_sum(x: Tensor) -> Tensor:
        return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)

    size = per_group_sum(torch.ones_like(index))
    mean = per_group_sum(scores) / size.to(scores.dtype)
    sq_dev = per_group_sum((scores - mean[index]) ** 2)
    std = (sq_dev / (size - 1).clamp(min=1).to(scores.dtype)).sqrt()
    return GroupStats(mean=mean[index], std=std[index], size=size[index])
