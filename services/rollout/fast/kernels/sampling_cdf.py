"""Sampling by inverse CDF (Triton, CUDA): a token per row from softmax(logits / T) with
one uniform draw per row, instead of a random number per column.

Why: the Gumbel-max kernel (``sampling.py``) is bound by its arithmetic, not by memory: a
Philox draw, two logs and an exp for each of 151,936 columns of each row (~155 us a decode
step at 256 rows on an H200). Here a column costs one exp in each of two light passes:

1. :func:`_cdf_partial_kernel`, one program per (row, split) of ``chunk`` columns: the
   split's max(x) and sum(exp(x - max)), x = logits / T (the logsumexp's partials).
2. :func:`_cdf_pick_kernel`, one program per row: merges the partials into the row's
   logsumexp and each split's mass, draws u in (0, 1), finds the split where the running
   mass passes u x total, then walks that split's columns in order, summing exp(x - max),
   to the column where it passes. That column is the token; its log-prob is x - logsumexp.

Splits are small (a few blocks), so the walk reads a few thousand columns per row.

The draw is exact up to float32 rounding: a token's chance is its share of the summed mass,
and u has 24 random bits, so a token of probability under ~6e-8 of the row is drawn with a
chance rounded to a multiple of 2^-24 (the Gumbel kernel's noise has a tail cut at about the
same level). Both passes sum in float32 in different orders; when the walk falls short of
the target by that rounding, the split's last column with any mass is taken. Same (seed,
offset), same tokens; the split layout could only move a draw within rounding of a boundary.
"""

from __future__ import annotations

import functools

import torch

from services.rollout.fast.kernels.runtime import cdiv, jit, tl, triton
from services.rollout.fast.kernels.sampling import check_logits, philox_words


def _cdf_partial_kernel(
    logits_ptr,
    stride_row,
    max_ptr,
    sum_ptr,
    vocab,
    chunk,
    temperature,
    BLOCK: tl.constexpr,
):
    """One (row, split): columns [split * chunk, min((split + 1) * chunk, vocab)); writes
    max(x) and sum(exp(x - max)), x = logits / T. One exp per column: each block is
    rescaled to the running max once."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    src = logits_ptr + row.to(tl.int64) * stride_row
    part = row.to(tl.int64) * tl.num_programs(1) + split  # partials are (rows, splits)
    begin = split * chunk
    end = begin + tl.minimum(chunk, vocab - begin)
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([], float("-inf"), tl.float32)
    run_sum = tl.full([], 0.0, tl.float32)
    for start in range(begin, end, BLOCK):
        cols = start + offs
        x = tl.load(src + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        x = x / temperature
        new_max = tl.maximum(run_max, tl.max(x, 0))
        # Nothing finite yet: subtract 0, not -inf, so no (-inf) - (-inf) = nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), 0)
        run_max = new_max
    tl.store(max_ptr + part, run_max)
    tl.store(sum_ptr + part, run_sum)


def _cdf_pick_kernel(
    logits_ptr,
    stride_row,
    max_ptr,
    sum_ptr,
    tokens_ptr,
    logprobs_ptr,
    vocab,
    chunk,
    splits,
    temperature,
    key_lo,
    key_hi,
    step_lo,
    step_hi,
    SPLITS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: the logsumexp from its partials, then the token where the running mass
    passes u x total (u from Philox: counter (0, row, step_lo, step_hi), key (key_hi << 32
    | key_lo)), and its log-prob."""
    row = tl.program_id(0)
    split = tl.arange(0, SPLITS_P2)
    ok = split < splits
    part = row.to(tl.int64) * splits + split
    part_max = tl.load(max_ptr + part, mask=ok, other=float("-inf"))
    part_sum = tl.load(sum_ptr + part, mask=ok, other=0.0)
    top = tl.max(part_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    mass = part_sum * tl.exp(part_max - shift)  # (SPLITS_P2,) each split's exp-sum, shifted
    total = tl.sum(mass, 0)
    lse = shift + tl.log(total)

    key = (key_hi.to(tl.uint64) << 32) | key_lo.to(tl.uint64)
    zero = tl.zeros([], tl.uint32)
    bits, _, _, _ = tl.philox(
        key,
        zero,
        zero + row.to(tl.uint32),
        zero + step_lo.to(tl.uint32),
        zero + step_hi.to(tl.uint32),
    )
    # 24 random bits -> u in (0, 1), both ends excluded, every value exact in float32.
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    target = u * total
    upto = tl.cumsum(mass, 0)  # mass of splits 0..j
    # The first split whose running mass passes the target; short by rounding: the last
    # split with any mass.
    passed = ok & (upto > target)
    last_with_mass = tl.max(tl.where(ok & (mass > 0), split, -1), 0)
    chosen = tl.min(tl.where(passed, split, SPLITS_P2), 0)
    chosen = tl.where(chosen == SPLITS_P2, tl.maximum(last_with_mass, 0), chosen)
    before = tl.sum(tl.where(split < chosen, mass, 0.0), 0)
    rest = target - before  # what the walk through the chosen split must pass

    src = logits_ptr + row.to(tl.int64) * stride_row
    begin = chosen * chunk
    end = begin + tl.minimum(chunk, vocab - begin)
    offs = tl.arange(0, BLOCK)
    walked = tl.full([], 0.0, tl.float32)
    found = tl.full([], vocab, tl.int32)  # vocab: not passed yet
    last_col = tl.full([], -1, tl.int32)  # the last column with mass seen
    for start in range(begin, end, BLOCK):
        cols = start + offs
        x = tl.load(src + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        e = tl.exp(x / temperature - shift)
        running = walked + tl.cumsum(e, 0)
        hit = tl.min(tl.where(running > rest, cols, vocab), 0)
        found = tl.minimum(found, hit)
        last_col = tl.maximum(last_col, tl.max(tl.where(e > 0, cols, -1), 0))
        walked += tl.sum(e, 0)
    token = tl.where(found < vocab, found, last_col)
    token = tl.minimum(tl.maximum(token, 0), vocab - 1)  # a row with nothing finite: still an index
    picked = tl.load(src + token).to(tl.float32) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, picked - lse)


@functools.cache
def _partial_kernel():
    return jit(_cdf_partial_kernel)


@functools.cache
def _pick_kernel():
    """Not specialized on the seed/step words: they change every call."""
    return jit(_cdf_pick_kernel, do_not_specialize=["key_lo", "key_hi", "step_lo", "step_hi"])


CDF_BLOCK = 1024
"""Columns per iteration of both passes (8 per thread of 4 warps)."""
CDF_SPLIT_BLOCKS = 4
"""Blocks per split: the walk of the second pass reads at most this many blocks per row."""


def cdf_splits(vocab: int, block: int, split_blocks: int) -> tuple[int, int]:
    """(splits, chunk): each row's vocabulary in splits of ``split_blocks`` whole blocks (the
    last one shorter)."""
    chunk = block * split_blocks
    return cdiv(vocab, chunk), chunk


def sample_inverse_cdf(
    logits: torch.Tensor,
    temperature: float,
    seed: int,
    offset: int,
    *,
    block: int = CDF_BLOCK,
    split_blocks: int = CDF_SPLIT_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), and float32 ``log_softmax(logits / T)`` at
    it; the arguments and results of :func:`sample_gumbel`, another random stream.

    logits (rows, V) bf16/fp16/fp32, any row stride, last dim contiguous. Randomness:
    Philox-4x32-10 keyed by ``seed`` mod 2^62, counter (0, row, ``offset`` mod 2^62 as two
    31-bit words); a caller draws a fresh ``offset`` (or seed) each step. Two launches, no
    host sync.
    """
    rows, vocab = logits.shape
    assert split_blocks >= 1, split_blocks
    check_logits(logits, temperature, block, block * split_blocks)
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if not rows:
        return tokens, logprobs
    splits, chunk = cdf_splits(vocab, block, split_blocks)
    stats = torch.empty((2, rows, splits), dtype=torch.float32, device=device)
    part_max, part_sum = stats
    _partial_kernel()[(rows, splits)](
        logits,
        logits.stride(0),
        part_max,
        part_sum,
        vocab,
        chunk,
        float(temperature),
        BLOCK=block,
        num_warps=4,
    )
    _pick_kernel()[(rows,)](
        logits,
        logits.stride(0),
        part_max,
        part_sum,
        tokens,
        logprobs,
        vocab,
        chunk,
        splits,
        float(temperature),
        *philox_words(seed, offset),
        SPLITS_P2=triton.next_power_of_2(splits),
        BLOCK=block,
        num_warps=4,
    )
    return tokens, logprobs
