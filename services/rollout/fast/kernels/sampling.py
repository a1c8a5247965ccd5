"""Sampling in one pass over a decode step's (rows, vocabulary) logits (Triton, CUDA):
Gumbel-max with Philox noise drawn in the kernel, and the drawn token's log-prob from an
online logsumexp, instead of a float32 noise tensor of the logits' size and two passes.

Two kernels. :func:`_sample_partial_kernel` splits each row's vocabulary into ``splits``
chunks of whole blocks, one program per (row, chunk): it draws the chunk's noise, keeps
its best (score, column) and its logsumexp as (max, rescaled sum), and writes those four
numbers. :func:`_sample_finish_kernel`, one program per row, merges the row's partials
into the token and its log-prob. Why split: occupancy. The sampling is compute-bound
(Philox, two logs and an exp per column), and one program per row of 8 warps at ~170
registers a thread fits once per SM: a decode batch of 256 rows ran as two rounds of 132
programs, 8 warps an SM, each walking a whole 151,936-column row (168 us on an H200).
Splitting gives about eight smaller programs per SM (a few waves of 3 resident ones),
and the partials cost a few floats per program.

The split changes no draw: a column's noise depends only on (seed, offset, row, column),
and the winner is the lowest column with the top score in every layout, so the same
(seed, offset) gives the same tokens whatever ``splits`` or ``block`` is.
"""

from __future__ import annotations

import functools

import torch

from services.rollout.fast.kernels.runtime import cdiv, jit, sm_count, tl, triton


def _sample_partial_kernel(
    logits_ptr,
    stride_row,
    max_ptr,
    sum_ptr,
    best_ptr,
    col_ptr,
    vocab,
    chunk,
    temperature,
    key_lo,
    key_hi,
    step_lo,
    step_hi,
    QUARTER: tl.constexpr,
):
    """One (row, split): columns [split * chunk, min((split + 1) * chunk, vocab)) of the row,
    x = logits / T; writes max(x), sum(exp(x - max)), the best x + Gumbel and its column.

    Columns go in blocks of 4 * QUARTER (chunk is a multiple), seen as a (QUARTER, 4) tile:
    Philox counter (c0 = column // 4, c1 = row, c2 = step_lo, c3 = step_hi) under the 62-bit
    key (key_hi << 32 | key_lo) gives the four columns 4 * c0 + j their four 32-bit words.
    The logsumexp is rescaled once per tile (one exp per element); each lane of the tile
    keeps its own best (score, column), reduced once after the loop.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    src = logits_ptr + row.to(tl.int64) * stride_row
    part = row.to(tl.int64) * tl.num_programs(1) + split  # partials are (rows, splits)
    begin = split * chunk  # < vocab: the host makes no empty split
    end = begin + tl.minimum(chunk, vocab - begin)  # not begin + chunk: no int32 overflow
    key = (key_hi.to(tl.uint64) << 32) | key_lo.to(tl.uint64)
    group = tl.arange(0, QUARTER)
    lane = tl.arange(0, 4)[None, :]
    zero = tl.zeros([QUARTER], tl.uint32)
    c1 = zero + row.to(tl.uint32)
    c2 = zero + step_lo.to(tl.uint32)
    c3 = zero + step_hi.to(tl.uint32)

    # One running max and sum for the program: a tile's max costs a reduction but saves the
    # second exp per element that a running max per lane needs (its rescale).
    row_max = tl.full([], float("-inf"), tl.float32)
    row_sum = tl.full([], 0.0, tl.float32)
    best = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    best_col = tl.zeros([QUARTER, 4], tl.int32)
    for start in range(begin, end, 4 * QUARTER):
        quad = start // 4 + group  # (QUARTER,): Philox counter c0
        cols = quad[:, None] * 4 + lane  # (QUARTER, 4), contiguous
        ok = cols < end
        x = tl.load(src + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        r0, r1, r2, r3 = tl.philox(key, quad.to(tl.uint32), c1, c2, c3)
        bits = tl.where(
            lane == 0,
            r0[:, None],
            tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])),
        )
        # 24 random bits -> u in (0, 1), both ends excluded and every value exact in float32:
        # no log(0), no log(-log(1)). Gumbel noise -log(-log(u)), bounded by about +-17.
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = x - tl.log(-tl.log(u))  # masked columns: -inf, never above `best`'s start
        win = score > best  # strict: a lane's earlier (lower) column keeps a tie
        best = tl.where(win, score, best)
        best_col = tl.where(win, cols, best_col)
        new_max = tl.maximum(row_max, tl.max(tl.max(x, 1), 0))
        # Nothing finite yet: subtract 0, not -inf, so no (-inf) - (-inf) = nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        tile_sum = tl.sum(tl.sum(tl.exp(x - shift), 1), 0)
        row_sum = row_sum * tl.exp(row_max - shift) + tile_sum
        row_max = new_max

    top = tl.max(tl.max(best, 1), 0)
    col = tl.min(tl.min(tl.where(best == top, best_col, vocab), 1), 0)
    tl.store(max_ptr + part, row_max)
    tl.store(sum_ptr + part, row_sum)
    tl.store(best_ptr + part, top)
    tl.store(col_ptr + part, col)


def _sample_finish_kernel(
    logits_ptr,
    stride_row,
    max_ptr,
    sum_ptr,
    best_ptr,
    col_ptr,
    tokens_ptr,
    logprobs_ptr,
    vocab,
    splits,
    temperature,
    SPLITS_P2: tl.constexpr,
):
    """One row: its ``splits`` partials -> token = argmax(x + Gumbel) (the lowest column
    among equal best scores, as one program over the whole row would pick) and
    logprob = x[token] - logsumexp(x), x = logits / T."""
    row = tl.program_id(0)
    split = tl.arange(0, SPLITS_P2)
    ok = split < splits
    part = row.to(tl.int64) * splits + split
    part_max = tl.load(max_ptr + part, mask=ok, other=float("-inf"))
    part_sum = tl.load(sum_ptr + part, mask=ok, other=0.0)
    part_best = tl.load(best_ptr + part, mask=ok, other=float("-inf"))
    part_col = tl.load(col_ptr + part, mask=ok, other=0)

    top_max = tl.max(part_max, 0)
    shift = tl.where(top_max == float("-inf"), 0.0, top_max)  # as in the partial kernel
    lse = shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), 0))
    top = tl.max(part_best, 0)
    # Padding lanes are -inf like an all -inf split: `ok` keeps their column out.
    token = tl.min(tl.where(ok & (part_best == top), part_col, vocab), 0)
    token = tl.minimum(token, vocab - 1)  # a NaN row matches nothing: still a valid index
    src = logits_ptr + row.to(tl.int64) * stride_row
    picked = tl.load(src + token).to(tl.float32) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, picked - lse)


@functools.cache
def _partial_kernel():
    """Jitted apart from the other kernels: its seed/step words change every call, and specializing
    on their values (== 1, divisible by 16) would compile new variants mid-run."""
    return jit(_sample_partial_kernel, do_not_specialize=["key_lo", "key_hi", "step_lo", "step_hi"])


@functools.cache
def _finish_kernel():
    return jit(_sample_finish_kernel)


SAMPLE_BLOCK = 2048
"""Columns per iteration of the partial kernel: 16 per thread of SAMPLE_WARPS warps (4 Philox
calls of 4 words), as in the one-program kernel before; a split is a whole number of blocks."""
SAMPLE_WARPS = 4
"""Warps per partial program: its tile max and sum cross 4 warps once per block, and at about
160 registers a thread 3 such programs (12 warps) are resident per SM of an H200."""
PROGRAMS_PER_SM = 8
"""Partial programs wanted per SM: a few waves of what an SM holds at once, so that no SM idles
long at the end (256 rows -> 5 splits -> 1280 programs on 132 SMs)."""
_WORD = (1 << 31) - 1  # seed and step travel as 31-bit words: always int32 arguments


def check_logits(logits: torch.Tensor, temperature: float, block: int, columns: int) -> None:
    """What both sampling kernels need of their arguments (``columns``: the most a program
    reads past a column it is given)."""
    vocab = logits.shape[-1]
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    assert logits.stride(-1) == 1 or vocab == 1, "the vocabulary dim must be contiguous"
    assert temperature > 0, "greedy decoding takes the argmax"
    assert block >= 16 and block & (block - 1) == 0, f"block must be a power of two >= 16: {block}"
    assert 0 < vocab < 2**31 - columns, vocab


def philox_words(seed: int, offset: int) -> tuple[int, int, int, int]:
    """(key_lo, key_hi, step_lo, step_hi): the 62-bit seed and offset as 31-bit words."""
    key, step = seed % 2**62, offset % 2**62
    return key & _WORD, key >> 31, step & _WORD, step >> 31


def sample_splits(
    rows: int, vocab: int, block: int, sms: int, splits: int | None = None
) -> tuple[int, int]:
    """(splits, chunk): how many programs share each row's vocabulary and how many columns
    (whole blocks) each covers. ``splits`` None: enough for about PROGRAMS_PER_SM programs
    per SM over all rows; at least one block each, and no split left empty (so the
    count can come out lower than asked). Depends only on shapes: a captured graph keeps it."""
    if splits is None:
        splits = cdiv(PROGRAMS_PER_SM * sms, max(rows, 1))
    splits = max(1, min(splits, cdiv(vocab, block)))
    chunk = cdiv(cdiv(vocab, splits), block) * block
    return cdiv(vocab, chunk), chunk


def sample_gumbel(
    logits: torch.Tensor,
    temperature: float,
    seed: int,
    offset: int,
    *,
    block: int = SAMPLE_BLOCK,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T) by Gumbel-max, in one pass over the logits.

    logits (rows, V) bf16/fp16/fp32, any row stride, last dim contiguous. Returns tokens
    (rows,) int64 and float32 ``log_softmax(logits / T)`` at them (logsumexp online, in
    float32). The same distribution as the exponential race of ``sampler.py``
    (argmax(p / E) = argmax(logits / T + Gumbel)), from another random stream.

    Two launches: a (rows, splits) grid of partial programs, each over ``chunk`` columns
    of a row (its best score and column, its max and rescaled exp-sum), then one program per
    row that merges them. ``splits`` None (see :func:`sample_splits`) fills the GPU with
    about PROGRAMS_PER_SM programs per SM: few rows split finely, a few hundred rows still
    split a few ways, since one program per row leaves an H200 mostly idle. ``splits=1``
    is one program over each row. The tokens do not depend on ``splits`` or ``block``.

    Randomness: Philox-4x32-10 keyed by ``seed`` mod 2^62, counter (column // 4, row,
    ``offset`` mod 2^62 as two 31-bit words): the same (seed, offset) gives the same tokens;
    a caller draws a fresh ``offset`` (or seed) each step. Rows < 2^32, V < 2^31 - block.
    Uniforms have 24 bits (Gumbel noise within about [-2.9, 16.6]: a tail of probability
    ~6e-8 is cut). Nothing syncs with the host.
    """
    rows, vocab = logits.shape
    check_logits(logits, temperature, block, block)
    assert splits is None or splits >= 1, splits
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if not rows:
        return tokens, logprobs
    splits, chunk = sample_splits(rows, vocab, block, sm_count(device), splits)
    stats = torch.empty((3, rows, splits), dtype=torch.float32, device=device)
    row_max, row_sum, best = stats  # each (rows, splits), contiguous
    best_col = torch.empty((rows, splits), dtype=torch.int32, device=device)
    _partial_kernel()[(rows, splits)](
        logits,
        logits.stride(0),
        row_max,
        row_sum,
        best,
        best_col,
        vocab,
        chunk,
        float(temperature),
        *philox_words(seed, offset),
        QUARTER=block // 4,
        num_warps=SAMPLE_WARPS,
    )
    _finish_kernel()[(rows,)](
        logits,
        logits.stride(0),
        row_max,
        row_sum,
        best,
        best_col,
        tokens,
        logprobs,
        vocab,
        splits,
        float(temperature),
        SPLITS_P2=triton.next_power_of_2(splits),
        num_warps=1 if splits <= 32 else 4,  # a few floats per row: one warp holds 32 splits
    )
    return tokens, logprobs
