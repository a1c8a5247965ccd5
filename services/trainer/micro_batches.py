"""Splitting a batch into mini-batches (one optimizer step each) and micro-batches (one
forward/backward each), across data-parallel ranks.

Two rules make the update independent of how it is split:

* every micro-batch loss is divided by the counts of its *whole mini-batch* (tokens and
  sequences over all ranks), so summing micro-batch gradients gives the mini-batch
  gradient (see ``meshrl.algorithms.aggregation``);
* every rank runs the same number of micro-batches, because each forward/backward of an
  FSDP model is a collective. A rank whose share runs out gets a *padding* micro-batch
  (one real row, weight 0): it joins the collectives and adds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the batch for one forward/backward on this rank."""

    rows: torch.Tensor  # (m,) int64 indices into the batch
    weight: float  # 1.0, or 0.0 for a padding micro-batch


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step: all of its rows, its global counts, this rank's micro-batches."""

    rows: torch.Tensor  # (n,) int64, every rank's rows
    token_count: int  # response tokens of the whole mini-batch (all ranks)
    seq_count: int  # sequences of the whole mini-batch (all ranks)
    micro_batches: list[MicroBatch]  # this rank's; the same count on every rank


def plan_epoch(
    response_lengths: torch.Tensor,
    mini_batch_rows: int,
    micro_batch_rows: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> list[MiniBatch]:
    """Plans one pass over a batch of ``len(response_lengths)`` rows.

    Args:
        response_lengths: ``(b,)`` response tokens of every row.
        mini_batch_rows: rows per optimizer step (``ppo_mini_batch_size * rollout.n``);
            the last mini-batch is smaller when ``b`` is not a multiple.
        micro_batch_rows: rows per forward/backward on one rank.
        shuffle: permute the rows first, with a generator seeded by ``seed`` (the same
            on every rank, so they agree on the plan).
        rank, world_size: this rank takes a contiguous share of each mini-batch.
    """
    b = response_lengths.numel()
    if b == 0:
        raise ValueError("cannot plan an empty batch")
    if mini_batch_rows < 1 or micro_batch_rows < 1:
        raise ValueError("mini- and micro-batch sizes must be positive")
    if shuffle:
        order = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(b)
    return [
        _plan_mini_batch(rows, response_lengths, micro_batch_rows, rank, world_size)
        for rows in order.split(mini_batch_rows)
    ]


def _plan_mini_batch(
    rows: torch.Tensor, lengths: torch.Tensor, micro_rows: int, rank: int, world_size: int
) -> MiniBatch:
    share = torch.tensor_split(rows, world_size)[rank]  # sizes differ by at most one
    largest_share = math.ceil(rows.numel() / world_size)
    count = max(1, math.ceil(largest_share / micro_rows))
    # Splitting this rank's share into exactly `count` parts keeps every part within
    # `micro_rows` and gives all ranks the same number of forward/backward passes.
    micro = [
        MicroBatch(part, 1.0) if part.numel() else MicroBatch(rows[:1], 0.0)
        for part in torch.tensor_split(share, count)
    ]
    return MiniBatch(
        rows=rows,
        token_count=int(lengths[rows].sum()),
        seq_count=rows.numel(),
        micro_batches=micro,
    )


def epoch_seed(base_seed: int, global_step: int, epoch: int) -> int:
    """Shuffle seed of one PPO epoch: the same on every rank, different every step/epoch."""
    return (base_seed * 1_000_003 + global_step) * 1_009 + epoch
