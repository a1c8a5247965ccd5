"""Sampling in one pass over a decode step's (rows, vocabulary) logits (Triton, CUDA):
Gumbel-max with Philox noise drawn in the kernel, and the drawn token's log-prob from an
online logsumexp, instead of a float32 noise tensor of the logits' size and two passes.
"""

from __future__ import annotations

import functools

import torch

from services.rollout.kernels.runtime import jit, tl


def _sample_gumbel_kernel(
    logits_ptr,
    stride_row,
    tokens_ptr,
    logprobs_ptr,
    vocab,
    temperature,
    key_lo,
    key_hi,
    step_lo,
    step_hi,
    QUARTER: tl.constexpr,
):
    """One row: token = argmax(x + Gumbel), logprob = x[token] - logsumexp(x), x = logits / T.

    Columns go in blocks of 4 * QUARTER, seen as a (QUARTER, 4) tile: Philox counter
    (c0 = column // 4, c1 = row, c2 = step_lo, c3 = step_hi) under the 62-bit key
    (key_hi << 32 | key_lo) gives the four columns 4 * c0 + j their four 32-bit words.
    Every lane of the tile keeps its own running max / rescaled sum (logsumexp) and its own
    best (score, column); the lanes are reduced once after the loop.
    """
    row = tl.program_id(0)
    src = logits_ptr + row.to(tl.int64) * stride_row
    key = (key_hi.to(tl.uint64) << 32) | key_lo.to(tl.uint64)
    group = tl.arange(0, QUARTER)
    lane = tl.arange(0, 4)[None, :]
    zero = tl.zeros([QUARTER], tl.uint32)
    c1 = zero + row.to(tl.uint32)
    c2 = zero + step_lo.to(tl.uint32)
    c3 = zero + step_hi.to(tl.uint32)

    running_max = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    running_sum = tl.zeros([QUARTER, 4], tl.float32)
    best = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    best_col = tl.zeros([QUARTER, 4], tl.int32)
    for start in range(0, vocab, 4 * QUARTER):
        quad = start // 4 + group  # (QUARTER,): Philox counter c0
        cols = quad[:, None] * 4 + lane  # (QUARTER, 4), contiguous
        ok = cols < vocab
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
        new_max = tl.maximum(running_max, x)
        # A lane with nothing finite yet subtracts 0, not -inf: no (-inf) - (-inf) = nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        running_max = new_max

    top_max = tl.max(tl.max(running_max, 1), 0)
    shift = tl.where(top_max == float("-inf"), 0.0, top_max)
    total = tl.sum(tl.sum(running_sum * tl.exp(running_max - shift), 1), 0)
    lse = shift + tl.log(total)
    top = tl.max(tl.max(best, 1), 0)
    token = tl.min(tl.min(tl.where(best == top, best_col, vocab), 1), 0)
    token = tl.minimum(token, vocab - 1)  # a NaN row matches nothing: still a valid index
    picked = tl.load(src + token).to(tl.float32) / temperature
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, picked - lse)


@functools.cache
def _sampling_kernel():
    """Jitted apart from the other kernels: its seed/step words change every call, and specializing
    on their values (== 1, divisible by 16) would compile new variants mid-run."""
    return jit(_sample_gumbel_kernel, do_not_specialize=["key_lo", "key_hi", "step_lo", "step_hi"])


SAMPLE_BLOCK = 4096
"""Columns per iteration of the sampling loop: 37 iterations over a 151,936 vocabulary, 16
columns (4 Philox calls of 4 words) per thread of 8 warps."""
_WORD = (1 << 31) - 1  # seed and step travel as 31-bit words: always int32 arguments


def sample_gumbel(
    logits: torch.Tensor,
    temperature: float,
    seed: int,
    offset: int,
    *,
    block: int = SAMPLE_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T) by Gumbel-max, in one pass over the logits.

    logits (rows, V) bf16/fp16/fp32, any row stride, last dim contiguous. Returns tokens
    (rows,) int64 and float32 ``log_softmax(logits / T)`` at them (logsumexp online, in
    float32). The same distribution as the exponential race of ``sampler.py``
    (argmax(p / E) = argmax(logits / T + Gumbel)), from another random stream.

    Randomness: Philox-4x32-10 keyed by ``seed`` mod 2^62, counter (column // 4, row,
    ``offset`` mod 2^62 as two 31-bit words): the same (seed, offset) gives the same tokens;
    a caller draws a fresh ``offset`` (or seed) each step. Rows < 2^32, V < 2^31 - block.
    Uniforms have 24 bits (Gumbel noise within about [-2.9, 16.6]: a tail of probability
    ~6e-8 is cut). Nothing syncs with the host.
    """
    rows, vocab = logits.shape
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    assert logits.stride(-1) == 1 or vocab == 1, "the vocabulary dim must be contiguous"
    assert temperature > 0, "greedy decoding takes the argmax"
    assert block >= 16 and block & (block - 1) == 0, f"block must be a power of two >= 16: {block}"
    assert 0 < vocab < 2**31 - block, vocab
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        key, step = seed % 2**62, offset % 2**62
        _sampling_kernel()[(rows,)](
            logits,
            logits.stride(0),
            tokens,
            logprobs,
            vocab,
            float(temperature),
            key & _WORD,
            key >> 31,
            step & _WORD,
            step >> 31,
            QUARTER=block // 4,
            num_warps=8,
        )
    return tokens, logprobs
