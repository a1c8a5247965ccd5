"""Splitting a batch into mini-batches (one optimizer step each) and micro-batches (one
forward/backward each), across data-parallel ranks.

Two rules make the update independent of how it is split:

* every micro-batch loss is divided by the counts of its *whole mini-batch* (tokens and
  sequences over all ranks), so summing micro-batch gradients gives the mini-batch
  gradient (see ``meshrl.algorithms.aggregation``);
* every rank runs the same number of micro-batches, because each forward/backward of an
  FSDP model is a collective. A rank whose share runs out gets a *padding* micro-batch
  (one real row, weight 0): it joins the collectives and adds nothing.

Micro-batches hold either a fixed number of rows or, with a token budget
(``use_dynamic_bsz``), as many rows as fit in ``max_tokens`` prompt+response tokens:
each rank's share is packed first-fit decreasing, and a rank that needs fewer
micro-batches than the busiest one splits its largest ones (never past the budget)
before it pads. A row longer than the budget gets a micro-batch of its own rather than an
error: rows are bounded by ``max_prompt_length + max_response_length`` anyway, and one
such row costs what it costs with ``ppo_micro_batch_size_per_gpu: 1``.
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
    seq_count: int  # sequences of the whole mini-batch (all ranks) with a response token
    # (a fully masked row is left out of N_seq, as verl's agg_loss leaves it out)
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
    max_tokens: int | None = None,
    sequence_lengths: torch.Tensor | None = None,
) -> list[MiniBatch]:
    """Plans one pass over a batch of ``len(response_lengths)`` rows.

    Args:
        response_lengths: ``(b,)`` response tokens of every row.
        mini_batch_rows: rows per optimizer step (``ppo_mini_batch_size * rollout.n``);
            the last mini-batch is smaller when ``b`` is not a multiple.
        micro_batch_rows: rows per forward/backward on one rank (without ``max_tokens``).
        shuffle: permute the rows first, with a generator seeded by ``seed`` (the same
            on every rank, so they agree on the plan).
        rank, world_size: this rank's share of each mini-batch: a contiguous slice of
            rows, or with ``max_tokens`` a share balanced by tokens.
        max_tokens: token budget of one micro-batch (``ppo_max_token_len_per_gpu``):
            ``sequence_lengths`` summed over its rows stays within it.
        sequence_lengths: ``(b,)`` prompt+response tokens of every row; needed with
            ``max_tokens``.
    """
    b = response_lengths.numel()
    if b == 0:
        raise ValueError("cannot plan an empty batch")
    if mini_batch_rows < 1 or micro_batch_rows < 1:
        raise ValueError("mini- and micro-batch sizes must be positive")
    if max_tokens is not None and (max_tokens < 1 or sequence_lengths is None):
        raise ValueError("a token budget must be positive and needs the sequence lengths")
    if shuffle:
        order = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(b)
    if max_tokens is None:
        return [
            _plan_mini_batch(rows, response_lengths, micro_batch_rows, rank, world_size)
            for rows in order.split(mini_batch_rows)
        ]
    assert sequence_lengths is not None  # a token budget without them was refused above
    return [
        _plan_by_tokens(rows, response_lengths, sequence_lengths, max_tokens, rank, world_size)
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
        seq_count=int((lengths[rows] > 0).sum()),
        micro_batches=micro,
    )


def _plan_by_tokens(
    rows: torch.Tensor,
    response_lengths: torch.Tensor,
    sequence_lengths: torch.Tensor,
    max_tokens: int,
    rank: int,
    world_size: int,
) -> MiniBatch:
    tokens = {r: int(sequence_lengths[r]) for r in rows.tolist()}
    shares = balanced_partition(list(tokens), tokens, world_size)
    # Every rank plans every share (the lengths are the same everywhere), so all agree on
    # the count without a collective.
    count = max(1, max(len(first_fit_decreasing(share, tokens, max_tokens)) for share in shares))
    parts = split_to_count(first_fit_decreasing(shares[rank], tokens, max_tokens), tokens, count)
    # A rank with fewer rows than micro-batches pads with the mini-batch's shortest row.
    shortest = min(tokens, key=lambda r: (tokens[r], r))
    position = {r: i for i, r in enumerate(tokens)}  # keep the mini-batch's row order
    micro = [
        MicroBatch(torch.tensor(sorted(part, key=position.__getitem__), dtype=torch.int64), 1.0)
        for part in parts
    ]
    micro += [MicroBatch(torch.tensor([shortest]), 0.0)] * (count - len(parts))
    return MiniBatch(
        rows=rows,
        token_count=int(response_lengths[rows].sum()),
        seq_count=int((response_lengths[rows] > 0).sum()),
        micro_batches=micro,
    )


def balanced_partition(rows: list[int], tokens: dict[int, int], parts: int) -> list[list[int]]:
    """``rows`` into ``parts`` lists of near-equal token sums: longest first, each to the
    lightest list (LPT). Each list keeps the rows' original order."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for r in sorted(rows, key=lambda r: (-tokens[r], r)):
        i = loads.index(min(loads))
        shares[i].append(r)
        loads[i] += tokens[r]
    position = {r: i for i, r in enumerate(rows)}
    return [sorted(share, key=position.__getitem__) for share in shares]


def first_fit_decreasing(rows: list[int], tokens: dict[int, int], budget: int) -> list[list[int]]:
    """Packs ``rows`` into as few bins of at most ``budget`` tokens as first-fit
    decreasing finds (within 11/9 of the optimum); a row over the budget is a bin alone."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for r in sorted(rows, key=lambda r: (-tokens[r], r)):
        for i, load in enumerate(loads):
            if load + tokens[r] <= budget:
                bins[i].append(r)
                loads[i] += tokens[r]
                break
        else:
            bins.append([r])
            loads.append(tokens[r])
    return bins


def split_to_count(bins: list[list[int]], tokens: dict[int, int], count: int) -> list[list[int]]:
    """Halves (by tokens) the heaviest bin of two or more rows until there are ``count``
    bins or none is left to split; halves never exceed the bin they came from."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda b: sum(tokens[r] for r in b))
        bins.remove(heaviest)
        bins += balanced_partition(heaviest, tokens, 2)
    return bins


def epoch_seed(base_seed: int, global_step: int, epoch: int) -> int:
    """Shuffle seed of one PPO epoch: the same on every rank, different every step/epoch."""
    return (base_seed * 1_000_003 + global_step) * 1_009 + epoch
