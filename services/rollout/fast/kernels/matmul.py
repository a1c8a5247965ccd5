"""GEMMs of the decode step for few rows (1..512), and gate/up with SiLU x up fused (Triton).

At a decode batch of 256 rows the projections of a Qwen2.5-0.5B-sized layer are latency
bound, not bandwidth or compute bound: on the H200 cuBLAS took 5.4 us for the fused qkv
(N=1152, K=896), 4.9 us for o_proj (896, 896), 11.0 us for the fused gate/up (2 x 4864,
896) plus 4.3 us of SiLU x up, and 7.6 us plus a 2.4 us split-K reduction for down_proj
(896, 4864), each several times its bandwidth or compute floor: its tiles leave SMs idle.
The kernels here pick tiles for the row count instead (:func:`default_config`: 16 to 64
rows a tile, and enough tiles, or split-K programs, to fill the SMs).

- :func:`linear`: ``F.linear(x, weight, bias)``; the weight as nn.Linear stores it (N, K),
  possibly rows of a fused buffer (any row stride).
- :func:`gate_up_silu`: ``silu(x @ Wg.T) * (x @ Wu.T)`` from the fused (2I, K) gate/up
  weight (:mod:`services.rollout.fast.fused_weights`'s layout) without writing the (M, 2I)
  projection: each program keeps a gate and an up accumulator for the same columns.

One kernel computes both (``GATE_UP`` is a constexpr: one accumulator or two, and the
epilogue). With split-K each (m tile, n tile, k split) program writes its float32 partial
sums into a (splits, M, width) workspace and a second small kernel adds them in split order
(deterministic: no atomics), adds the bias or applies SiLU x up, and rounds.

Grids and configs depend only on shapes, and nothing syncs with the host: the calls can be
captured in a CUDA graph (the outputs and the workspace come from torch's allocator, so from
the graph's pool when captured).

Precision: products summed in float32 (the order differs from cuBLAS's, so a result near a
rounding boundary may round the other way: one ulp). :func:`linear` adds the bias to the
float32 sum and rounds once, as cuBLAS's bias epilogue does. Float32 inputs use full
precision ("ieee") dots, as torch's default (TF32 off) does. Offsets are int32: x, the
weight buffer and the output must each hold fewer than 2**31 elements.

Speed: with K, N and the row strides multiples of 16 (Triton specializes on that; every
real model's are) and K a multiple of block_k, the loads are 16-byte vectors in a cp.async
pipeline (seen in the PTX compiled for sm_90: wgmma for 64-row tiles, mma.sync for 16 and
32). Any other K works, but its masked loads go element by element.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.rollout.fast.kernels.runtime import cdiv, is_interpreted, jit, sm_count, tl

MIN_BLOCK = 16
"""tl.dot needs at least 16 along each dimension: a tile of one row is 16 rows, 15 masked."""
MAX_SPLIT_K = 8
MIN_BLOCKS_PER_SPLIT = 8
"""A k split is worth a partial write only with a few pipelined k blocks of its own; with
block_k 64, K=896 (14 blocks) is never split, down_proj's K=4864 (76 blocks) may be."""
REDUCE_BLOCK = 512
"""Columns per program of the split-K reduction (a row's 896 columns in two programs)."""


@dataclass(frozen=True)
class MatmulConfig:
    """One launch's tiling: a program computes a (block_m, block_n) tile of the output
    (two of them, gate and up, in :func:`gate_up_silu`) over K in steps of block_k, or over
    its 1 / split_k share of K when split_k > 1."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            assert size >= MIN_BLOCK and size & (size - 1) == 0, f"{name} {size}: 2**j >= 16"
        assert self.num_warps in (1, 2, 4, 8, 16), f"num_warps {self.num_warps}"
        assert self.num_stages >= 1 and self.split_k >= 1, self


def default_config(m: int, n: int, k: int, device: torch.device | str) -> MatmulConfig:
    """A config for an (m, k) x (k, n) product (``n`` the output columns: I for
    :func:`gate_up_silu`) on ``device``.

    Rows a tile: the fewest of 16/32/64 that cover ``m``; then, if the tiles are fewer
    than the SMs, either K is split (long K: at least 2 x MIN_BLOCKS_PER_SPLIT blocks, as
    down_proj's 4864) into enough splits to fill them, or the row tiles are halved (down to
    16 rows) until they do. Columns a tile: 64. block_k: 128 for 16-row tiles (the x tile is
    small; longer steps keep each pipeline stage's loads large), else 64.
    """
    sms = sm_count(torch.device(device))
    block_n = 64
    block_m = MIN_BLOCK if m <= 16 else 32 if m <= 32 else 64
    block_k = 128 if block_m == MIN_BLOCK else 64

    def tiles(rows: int) -> int:
        return cdiv(m, rows) * cdiv(n, block_n)

    split_k = 1
    if tiles(block_m) < sms and k >= 2 * MIN_BLOCKS_PER_SPLIT * 64:
        block_k = 64
        wanted = cdiv(sms, tiles(block_m))
        split_k = max(1, min(MAX_SPLIT_K, wanted, cdiv(k, block_k) // MIN_BLOCKS_PER_SPLIT))
    else:
        while block_m > MIN_BLOCK and tiles(block_m) < sms:
            block_m //= 2
    return MatmulConfig(block_m, block_n, block_k, num_warps=4, num_stages=3, split_k=split_k)


PARTIAL_WAVE = 0.85
"""Programs :func:`partial_config` aims for, as a share of the SMs: one wave, a little
short of full (so the consumer's first programs find SMs free)."""


@functools.cache
def partial_config(m: int, n: int, k: int, sms: int) -> MatmulConfig:
    """The tiling of :func:`linear_partials` for an (m, k) x (k, n) projection whose
    consumer sums the partials (``add_rms_norm_partials``), on a GPU of ``sms`` SMs.

    Tiles of 64 rows (16 or 32 for fewer), K steps of 128, and K split so that the
    programs make about ``PARTIAL_WAVE`` of one wave: many more programs than a tile per
    program would make at a few hundred rows, each walking a short stretch of K. Columns a
    tile: 64; 128 where K is long (>= 2,048, down_proj's) and there are 128 rows or more,
    with 4 pipeline stages there (3 elsewhere). On the H200 (``benchmarks/rollout/split_k.py``)
    these were the best configs of a search for o_proj and down_proj at 256 rows and
    down_proj at 64 (for o_proj at 64 rows the best had 4 splits of 32-column tiles).
    """
    block_m = MIN_BLOCK if m <= 16 else 32 if m <= 32 else 64
    long_k = k >= 2048
    block_n = 128 if long_k and m >= 128 else 64
    block_k = 128
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split = max(1, min(cdiv(k, block_k), int(PARTIAL_WAVE * sms) // tiles))
    return MatmulConfig(block_m, block_n, block_k, 4, 4 if long_k else 3, split)


def split_plan(k: int, config: MatmulConfig) -> tuple[int, int]:
    """(splits, k_per_split): whole block_k steps per split, and no empty split (asking 3
    splits of K=200 at block_k 64 gives 2 of 128 columns: the third would have none)."""
    k_per_split = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    return cdiv(k, k_per_split), k_per_split


def _matmul_kernel(
    x_ptr,
    x_stride_m,
    w_ptr,
    w_stride_n,
    bias_ptr,
    out_ptr,
    out_stride_split,
    out_stride_m,
    M,
    N,
    K,
    inter,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (m tile, n tile, k split): out[rows, cols] = x[rows, ks] @ w[cols, ks].T over the
    split's ks = [split * k_per_split, ...) (all of K when not SPLIT).

    x (M, K) and w (>= N rows, K) have unit column strides. GATE_UP: N is I and each tile
    also sums x @ w[inter + cols].T (the up rows, inter = I), and writes
    silu(gate) * up; else it writes x @ w.T (+ bias).
    SPLIT=False: writes the tile in out's dtype (out (M, N)).
    SPLIT=True: writes the float32 sums at out[split, rows, cols] (and the up sums at
    out[split, rows, inter + cols]) for _split_k_reduce_kernel; no bias, no SiLU.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    ks = k_begin + tl.arange(0, BLOCK_K)

    # The weight tile is read as (BLOCK_K, BLOCK_N), w's rows as columns: tl.dot(x, w)
    # needs no transpose, and loads stay contiguous along K.
    x_ptrs = x_ptr + rows[:, None] * x_stride_m + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * w_stride_n + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATE_UP:
        up_ptrs = w_ptrs + inter * w_stride_n
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            # Whole blocks only: masks on rows and columns alone, so loads keep their
            # 16-byte vectors along K.
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_end
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            # The interpreter's tl.dot multiplies bfloat16 as raw uint16 bits: float32
            # operands there (exact: a product of two bf16 is exact in float32). On a GPU
            # bf16/fp16 go to the tensor cores as they are.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:
                u = tl.load(up_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                u = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_IN_FP32:
                u = u.to(tl.float32)
            acc_up = tl.dot(x, u, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    keep = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + split * out_stride_split + rows[:, None] * out_stride_m + cols[None, :]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=keep)
        if GATE_UP:
            tl.store(out_ptrs + inter, acc_up, mask=keep)
    elif GATE_UP:
        # The two-step torch path's rounding: each sum rounded to the model dtype first (as
        # F.linear's output is), then silu.py's float32 math on those values, rounded once.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        result = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)


def _split_k_reduce_kernel(
    part_ptr,
    part_stride_split,
    part_stride_m,
    bias_ptr,
    out_ptr,
    out_stride_m,
    N,
    inter,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One (row, column block): the splits' float32 partials summed in split order, then
    the bias added (or GATE_UP: the gate sums at columns cols, the up sums at inter + cols,
    through SiLU x up) and rounded once to out's dtype."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < N
    src = part_ptr + row * part_stride_m + cols
    total = tl.zeros([BLOCK], tl.float32)
    if GATE_UP:
        total_up = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(src + split * part_stride_split, mask=keep, other=0.0)
        if GATE_UP:
            total_up += tl.load(src + split * part_stride_split + inter, mask=keep, other=0.0)
    if GATE_UP:  # the matmul kernel's unsplit epilogue, the same rounding
        gate = total.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = total_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        total = gate / (1.0 + tl.exp(-gate)) * up
    elif HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride_m + cols, total.to(out_ptr.dtype.element_ty), mask=keep)


@functools.cache
def _kernels() -> SimpleNamespace:
    """The two kernels, jitted once (interpreted when TRITON_INTERPRET is on now)."""
    matmul = jit(_matmul_kernel)
    return SimpleNamespace(
        matmul=matmul,
        reduce=jit(_split_k_reduce_kernel),
        interpreted=is_interpreted(matmul),
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for few rows.

    x (M, K), any row stride, unit column stride; weight (N, K) in x's dtype, any row
    stride, unit column stride (rows of a fused buffer, as the q/k/v views of
    :mod:`services.rollout.fast.fused_weights`, are fine); bias (N,) contiguous, or None.
    ``config`` (None: :func:`default_config`) sets the tiling and split-K.
    Returns (M, N) in x's dtype: the float32 sum plus the bias, rounded once.
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} for x {tuple(x.shape)}"
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1, "bias (N,), contiguous"
        assert bias.dtype == x.dtype and bias.device == x.device
    return _launch(x, weight, bias, n, gate_up=False, config=config)


def gate_up_silu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    *,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``silu(x @ Wg.T) * (x @ Wu.T)`` from the fused gate/up weight (2I, K): rows [0, I)
    the gate projection's, rows [I, 2I) the up projection's. x (M, K) as :func:`linear`'s;
    the weight any row stride, unit column stride. Returns (M, I) in x's dtype.

    The (M, 2I) projection is never written (nor, with split-K, rounded: the workspace
    holds float32 partials). Rounding follows ``kernels.silu_mul_halves(F.linear(x, W))``:
    the gate and up sums rounded to x's dtype, SiLU x up in float32 from those, rounded
    once. What remains different: the float32 summation order (one ulp of a gate or up
    value near a rounding boundary, as between two GEMM libraries). Against the eager
    ``fused_ops.silu_mul_halves`` (which rounds silu(gate) to the model dtype before the
    product) results differ by up to about an ulp of the output in bf16.
    """
    m, k = x.shape
    assert gate_up_weight.shape[1] == k and gate_up_weight.shape[0] % 2 == 0
    inter = gate_up_weight.shape[0] // 2
    return _launch(x, gate_up_weight, None, inter, gate_up=True, config=config)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, config: MatmulConfig) -> torch.Tensor:
    """``x @ weight.T`` as float32 partial sums over ``config``'s K splits: (splits, M, N).

    Their sum in split order, rounded once, is what :func:`linear` (without bias) returns
    with the same config. For a consumer that reads the product anyway (a residual add and
    norm) and can sum the partials where it loads them, instead of a reduction kernel of
    their own. x and weight as :func:`linear`'s.

    (SiLU x up computed as each x tile is loaded, so that down_proj would need no SiLU
    kernel before it, was bit for bit right and 1.37x slower a step: the exp and both
    halves' loads in the k loop stall its pipeline. Code at 2445eaa.)
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} for x {tuple(x.shape)}"
    _check_operands(x, weight)
    splits, k_per_split = split_plan(k, config)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    if m and n:
        grid = (cdiv(m, config.block_m), cdiv(n, config.block_n), splits)
        _kernels().matmul[grid](  # x in the bias's place: not read without HAS_BIAS
            x, x.stride(0), weight, weight.stride(0), x, parts, parts.stride(0),
            parts.stride(1), m, n, k, n, k_per_split,
            **_constants(x, k, config, has_bias=False, gate_up=False, split=True),
        )  # fmt: skip
    return parts


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need unit column strides"
    assert x.dtype == weight.dtype and x.device == weight.device, "x and weight must match"
    assert x.shape[1] > 0, "K must be positive"


def _constants(x, k, config, *, has_bias, gate_up, split) -> dict:
    """The matmul kernel's compile-time arguments and launch options."""
    return dict(
        HAS_BIAS=has_bias,
        GATE_UP=gate_up,
        SPLIT=split,
        # Whole K blocks in every split: k_per_split is a multiple of block_k already.
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        DOT_IN_FP32=_kernels().interpreted and x.dtype == torch.bfloat16,
        # float32 models: full-precision dots, as torch.matmul (TF32 off by default) does.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _launch(x, weight, bias, n, *, gate_up, config):
    """The matmul kernel over (m tiles, n tiles, splits), and the reduction when split.
    ``n`` is the output width: N, or I for gate/up (whose up rows start at row n)."""
    m, k = x.shape
    _check_operands(x, weight)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = config or default_config(m, n, k, x.device)
    splits, k_per_split = split_plan(k, config)
    kernels = _kernels()
    constants = _constants(
        x, k, config, has_bias=bias is not None, gate_up=gate_up, split=splits > 1
    )
    grid = (cdiv(m, config.block_m), cdiv(n, config.block_n), splits)
    bias_arg = bias if bias is not None else x  # not read without HAS_BIAS
    if splits == 1:
        kernels.matmul[grid](
            x, x.stride(0), weight, weight.stride(0), bias_arg, out, 0, out.stride(0),
            m, n, k, n, k_per_split, **constants,
        )  # fmt: skip
        return out
    parts = torch.empty((splits, m, 2 * n if gate_up else n), dtype=torch.float32, device=x.device)
    kernels.matmul[grid](
        x, x.stride(0), weight, weight.stride(0), bias_arg, parts, parts.stride(0),
        parts.stride(1), m, n, k, n, k_per_split, **constants,
    )  # fmt: skip
    kernels.reduce[(m, cdiv(n, REDUCE_BLOCK))](
        parts, parts.stride(0), parts.stride(1), bias_arg, out, out.stride(0), n, n,
        SPLITS=splits, HAS_BIAS=bias is not None, GATE_UP=gate_up, BLOCK=REDUCE_BLOCK,
        num_warps=4,
    )  # fmt: skip
    return out
