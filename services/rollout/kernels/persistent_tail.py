"""The rest of a decoder layer after its attention, as one persistent launch (Triton).

At a decode batch of 256 rows a Qwen2.5-0.5B-sized layer is bound by kernel count, not by
bytes or FLOPs (docs/rollout.md, "Where a decode step's time goes"): after the attention,
o_proj, the residual add + norm, gate/up, SiLU x up, down_proj, its split-K reduction and
the next residual add + norm are seven launches, each paying a ramp and a tail while most
SMs wait. Here one launch does all of it. A grid of one program per SM works through a
list of tasks in five stages:

    O   (row block, column tile):   x1 = x + attn @ Wo.T (+ bo)
    N   (norm rows):                h2 = rms_norm(x1) * w_post
    G   (row block, column tile):   act = silu(h2 @ Wg.T) * (h2 @ Wu.T)
    D   (row block, k chunk, tile): partial[k chunk] = act[:, chunk] @ Wd[:, chunk].T
    R   (norm rows):                x_out = x1 + sum(partials) (+ bd);
                                    h_out = rms_norm(x_out) * w_next

A task waits only for the tasks it reads (an int32 counter per row block, or per row block
and k chunk, that producers raise with a release atomic after their stores and consumers
read with acquire atomics), so the stages overlap: gate/up tiles of the first row block run
while the o_proj tiles of the last are still being summed.

Why this cannot deadlock: tasks are numbered so that every task depends only on tasks of
smaller numbers, and each program takes its tasks in increasing order, either the fixed
share ``pid, pid + G, ...`` (``dynamic=False``: needs all G programs resident at once, one
per SM) or the next number from an atomic queue (``dynamic=True``: needs nothing). The
lowest unfinished task then always has its inputs done and a program working on it. A wait
that still lasts past ``max_spins`` polls (a broken assumption, never a normal run) gives
up, counts an error in the workspace and lets the launch end: :meth:`TailWorkspace.check`
raises on it, so a bug shows as an error, not a hung GPU.

The last program to leave zeroes the counters, so the next launch (the next layer, or the
next replay of a CUDA graph) starts clean without a memset of its own.

Rounding follows the unfused torch path (F.linear's output rounded to the model dtype,
``fused_ops.add_rms_norm``'s bf16 residual and float32 statistics, ``silu.py``'s SiLU x up
from rounded gate and up sums); the float32 summation orders differ from cuBLAS's.
Intermediates written by one program and read by another are loaded with ``.cg`` (past the
SM's own L1, which another SM's stores do not update).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.rollout.kernels.runtime import cdiv, is_interpreted, jit, sm_count, tl

MAX_SPINS = 1 << 20
"""Polls of one counter before a wait gives up (a fraction of a second on an H200): far past any
real wait, short of a hung device."""


@dataclass(frozen=True)
class TailConfig:
    """Tiling of the five stages (all powers of two; ``block_m`` a multiple of
    ``norm_rows``; ``down_chunk`` a multiple of ``block_n_gate`` and ``block_k``)."""

    block_m: int = 64  # rows of an O, G or D tile (one row block)
    block_n_o: int = 64  # columns of an O tile
    block_n_gate: int = 64  # intermediate columns of a G tile (its gate and its up)
    block_n_down: int = 64  # columns of a D tile
    block_k: int = 64  # the K step of every tile's loop
    down_chunk: int = 1216  # intermediate columns summed by one D task (its k chunk)
    norm_rows: int = 8  # rows of an N or R task
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1  # programs a launch starts per SM (more hide load latency)
    dynamic: bool = False  # tasks from an atomic queue instead of a fixed share

    def __post_init__(self):
        for name in ("block_m", "block_n_o", "block_n_gate", "block_n_down", "block_k"):
            size = getattr(self, name)
            assert size >= 16 and size & (size - 1) == 0, f"{name} {size}: 2**j >= 16"
        assert self.norm_rows >= 1 and self.norm_rows & (self.norm_rows - 1) == 0
        assert self.block_m % self.norm_rows == 0, "block_m must be a multiple of norm_rows"
        assert self.down_chunk % self.block_n_gate == 0, "down_chunk: whole G tiles"
        assert self.down_chunk % self.block_k == 0, "down_chunk: whole K steps"


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(rows: int, hidden: int) -> TailConfig:
    """Row blocks of 64 (one warpgroup's wgmma) from 33 rows up, else 16 or 32; norm tasks
    of up to 8 rows, fewer for wide rows (a task holds its rows in registers)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    wide = _next_power_of_2(hidden)
    return TailConfig(block_m=block_m, norm_rows=max(1, min(8, 8192 // wide)))


@dataclass(frozen=True)
class TailWeights:
    """One layer's weights after its attention (views of the model's own parameters)."""

    o_weight: torch.Tensor  # (hidden, heads * head_dim)
    o_bias: torch.Tensor | None  # (hidden,)
    post_norm_weight: torch.Tensor  # (hidden,), the post-attention RMSNorm's
    gate_up_weight: torch.Tensor  # (2 * inter, hidden): gate rows, then up rows
    down_weight: torch.Tensor  # (hidden, inter)
    down_bias: torch.Tensor | None  # (hidden,)
    next_norm_weight: torch.Tensor  # (hidden,), the next layer's input norm (or the final)


@dataclass(frozen=True)
class TailPlan:
    """Task counts and stage offsets of one launch (they depend on shapes only)."""

    row_blocks: int
    o_cols: int  # O tiles per row block
    norm_tasks: int  # N tasks (= R tasks)
    gate_cols: int  # G tiles per row block
    chunks: int  # D k chunks
    down_cols: int  # D tiles per row block and chunk

    @property
    def offsets(self) -> tuple[int, int, int, int, int]:
        """First task of N, G, D, R, and the total."""
        n = self.row_blocks * self.o_cols
        g = n + self.norm_tasks
        d = g + self.row_blocks * self.gate_cols
        r = d + self.row_blocks * self.chunks * self.down_cols
        return n, g, d, r, r + self.norm_tasks

    @property
    def counters(self) -> int:
        """queue, exits, then the O, N, G (per chunk) and D counters of each row block."""
        return 2 + self.row_blocks * (3 + self.chunks)


def plan(rows: int, hidden: int, inter: int, config: TailConfig) -> TailPlan:
    return TailPlan(
        row_blocks=cdiv(rows, config.block_m),
        o_cols=cdiv(hidden, config.block_n_o),
        norm_tasks=cdiv(rows, config.norm_rows),
        gate_cols=cdiv(inter, config.block_n_gate),
        chunks=cdiv(inter, config.down_chunk),
        down_cols=cdiv(hidden, config.block_n_down),
    )


class TailWorkspace:
    """The counters every launch on one device shares (launches run one after another on
    a stream; each leaves them at zero) and the error count of waits that gave up."""

    def __init__(self, device: torch.device | str, max_counters: int = 4096):
        self.counters = torch.zeros(max_counters, dtype=torch.int32, device=device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.counters.zero_()
        self.errors.zero_()

    def check(self) -> None:
        """Raises if a launch since the last reset gave up waiting (a sync with the host)."""
        failed = int(self.errors.item())
        if failed:
            raise RuntimeError(
                f"layer_tail: {failed} wait(s) gave up after {MAX_SPINS} polls: a task's "
                "inputs never came (were all programs resident at once?)"
            )


# ---- the kernel: stage helpers first (jitted in _kernels), then the task loop ----


def _wait(counter_ptr, expected, max_spins, error_ptr):
    """Polls ``counter_ptr`` (acquire) until it reaches ``expected``, or gives up."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < expected) & (spins < max_spins):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < expected:
        tl.atomic_add(error_ptr, 1)


def _signal(counter_ptr):
    """Raises ``counter_ptr`` once this program's stores are done (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


def _tile_dot(
    a_ptr, a_stride, rows, row_ok, w_ptr, w_stride, cols, col_ok, k_begin, k_end,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, CG: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_N) float32 sums of a[rows, k] * w[cols, k] over [k_begin, k_end).
    CG: ``a`` was written in this launch (read past L1)."""
    ks = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * a_stride + ks[None, :]
    w_ptrs = w_ptr + cols[None, :] * w_stride + ks[:, None]  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_end
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        if CG:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if DOT_IN_FP32:  # the interpreter multiplies bf16 as raw bits (see matmul.py)
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


def _gate_up_dot(
    a_ptr, a_stride, rows, row_ok, w_ptr, w_stride, inter, cols, col_ok, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """:func:`_tile_dot` against the gate rows ``cols`` and the up rows ``inter + cols``
    of the fused weight at once (each ``a`` tile read once for both); a from this launch."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * a_stride + ks[None, :]
    g_ptrs = w_ptr + cols[None, :] * w_stride + ks[:, None]  # (BLOCK_K, BLOCK_N)
    u_ptrs = g_ptrs + inter * w_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = (k0 + ks) < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0, cache_modifier=".cg")
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        gate = tl.dot(a, g, gate, input_precision=PRECISION)
        up = tl.dot(a, u, up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return gate, up


def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


def _global_time():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


def _rms_norm_rows(x, weight, hidden, eps, dtype: tl.constexpr):
    """``fused_ops.rms_norm`` of rows x (R, BLOCK_H) float32 (already rounded to dtype),
    masked columns zero, with ``weight`` (BLOCK_H,) float32: float32 statistics, normed
    rows rounded, times the weight, rounded."""
    variance = tl.sum(x * x, axis=1) / hidden
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(dtype).to(tl.float32)
    return (weight[None, :] * normed).to(dtype)


def _o_task(
    task, attn_ptr, attn_stride, x_ptr, x_stride, wo_ptr, wo_stride, bo_ptr, x1_ptr, o_done,
    M, HIDDEN, HA, O_COLS,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """O tile ``task``: x1 = x + attn @ Wo.T (+ bo), o rounded first (F.linear's output)."""
    block = task // O_COLS
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (task % O_COLS) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < HIDDEN
    acc = _tile_dot(
        attn_ptr, attn_stride, rows, row_ok, wo_ptr, wo_stride, cols, col_ok, 0, HA,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, False, DOT_IN_FP32, PRECISION,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bo_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    keep = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=keep, other=0.0)
    dtype = x1_ptr.dtype.element_ty
    x1 = (x.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype)
    tl.store(x1_ptr + rows[:, None] * HIDDEN + cols[None, :], x1, mask=keep)
    _signal(o_done + block)


def _norm_task(
    task, x1_ptr, post_w_ptr, h2_ptr, o_done, n_done, error_ptr, M, HIDDEN, O_COLS, eps,
    max_spins, NORM_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """N task ``task`` (relative): h2 = rms_norm(x1) * w_post, once its row block's O
    tiles are done."""
    block = (task * NORM_ROWS) // BLOCK_M
    rows = task * NORM_ROWS + tl.arange(0, NORM_ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    weight = tl.load(post_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # before
    _wait(o_done + block, O_COLS, max_spins, error_ptr)  # the wait: not of this launch
    keep = (rows < M)[:, None] & col_ok[None, :]
    offs = rows[:, None] * HIDDEN + cols[None, :]
    x1 = tl.load(x1_ptr + offs, mask=keep, other=0.0, cache_modifier=".cg")
    dtype = h2_ptr.dtype.element_ty
    h2 = _rms_norm_rows(x1.to(tl.float32), weight, HIDDEN, eps, dtype)
    tl.store(h2_ptr + offs, h2, mask=keep)
    _signal(n_done + block)


def _gate_up_task(
    task, h2_ptr, wgu_ptr, wgu_stride, act_ptr, n_done, g_done, error_ptr,
    M, HIDDEN, INTER, GATE_COLS, CHUNKS, max_spins,
    NORM_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOWN_CHUNK: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """G tile ``task`` (relative): act = silu(h2 @ Wg.T) * (h2 @ Wu.T), once its row
    block's norms are done."""
    block = task // GATE_COLS
    col_tile = task % GATE_COLS
    block_rows = tl.minimum(M - block * BLOCK_M, BLOCK_M)
    _wait(n_done + block, (block_rows + NORM_ROWS - 1) // NORM_ROWS, max_spins, error_ptr)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < INTER
    gate, up = _gate_up_dot(
        h2_ptr, HIDDEN, rows, row_ok, wgu_ptr, wgu_stride, INTER, cols, col_ok, HIDDEN,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_IN_FP32, PRECISION,
    )  # fmt: skip
    # silu.py's rounding: gate and up rounded as F.linear's output, then float32.
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    keep = row_ok[:, None] & col_ok[None, :]
    tl.store(act_ptr + rows[:, None] * INTER + cols[None, :], act, mask=keep)
    _signal(g_done + block * CHUNKS + (col_tile * BLOCK_N) // DOWN_CHUNK)


def _down_task(
    task, act_ptr, wd_ptr, wd_stride, part_ptr, g_done, d_done, error_ptr,
    M, HIDDEN, INTER, CHUNKS, DOWN_COLS, max_spins,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_G: tl.constexpr,
    BLOCK_K: tl.constexpr, DOWN_CHUNK: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """D tile ``task`` (relative): part[chunk] = act[:, chunk] @ Wd[:, chunk].T in
    float32, once the G tiles of its row block and chunk are done."""
    per_block = CHUNKS * DOWN_COLS
    block = task // per_block
    chunk = (task % per_block) // DOWN_COLS
    k_begin = chunk * DOWN_CHUNK
    k_end = tl.minimum(k_begin + DOWN_CHUNK, INTER)
    tiles = (k_end - k_begin + BLOCK_N_G - 1) // BLOCK_N_G
    _wait(g_done + block * CHUNKS + chunk, tiles, max_spins, error_ptr)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (task % DOWN_COLS) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < HIDDEN
    acc = _tile_dot(
        act_ptr, INTER, rows, row_ok, wd_ptr, wd_stride, cols, col_ok, k_begin, k_end,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True, DOT_IN_FP32, PRECISION,
    )  # fmt: skip
    keep = row_ok[:, None] & col_ok[None, :]
    tl.store(part_ptr + chunk * M * HIDDEN + rows[:, None] * HIDDEN + cols[None, :], acc, mask=keep)
    _signal(d_done + block)


def _reduce_task(
    task, part_ptr, x1_ptr, bd_ptr, next_w_ptr, x_out_ptr, h_out_ptr, o_done, d_done,
    error_ptr, M, HIDDEN, O_COLS, DOWN_COLS, eps, max_spins,
    HAS_BIAS: tl.constexpr, NORM_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """R task ``task`` (relative): x_out = x1 + sum of the partials (+ bd), h_out =
    rms_norm(x_out) * w_next, once every D tile of its row block is done. What is ready
    earlier (the weights; x1, once its O tiles are) is loaded before the long wait."""
    block = (task * NORM_ROWS) // BLOCK_M
    rows = task * NORM_ROWS + tl.arange(0, NORM_ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    keep = (rows < M)[:, None] & col_ok[None, :]
    offs = rows[:, None] * HIDDEN + cols[None, :]
    weight = tl.load(next_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    down = tl.zeros([NORM_ROWS, BLOCK_H], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bd_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    _wait(o_done + block, O_COLS, max_spins, error_ptr)
    x1 = tl.load(x1_ptr + offs, mask=keep, other=0.0, cache_modifier=".cg")
    _wait(d_done + block, CHUNKS * DOWN_COLS, max_spins, error_ptr)
    for chunk in tl.static_range(CHUNKS):  # in chunk order: the same sums every launch
        down += tl.load(part_ptr + chunk * M * HIDDEN + offs, mask=keep, other=0.0,
                        cache_modifier=".cg")  # fmt: skip
    if HAS_BIAS:
        down += bias[None, :]
    dtype = x_out_ptr.dtype.element_ty
    x_out = (x1.to(tl.float32) + down.to(dtype).to(tl.float32)).to(dtype)
    tl.store(x_out_ptr + offs, x_out, mask=keep)
    h = _rms_norm_rows(x_out.to(tl.float32), weight, HIDDEN, eps, dtype)
    tl.store(h_out_ptr + offs, h, mask=keep)


def _layer_tail_kernel(
    attn_ptr, attn_stride, x_ptr, x_stride,
    wo_ptr, wo_stride, bo_ptr, post_w_ptr, wgu_ptr, wgu_stride, wd_ptr, wd_stride, bd_ptr,
    next_w_ptr, x1_ptr, h2_ptr, act_ptr, part_ptr, x_out_ptr, h_out_ptr,
    counter_ptr, error_ptr, trace_ptr,
    M, HIDDEN, HA, INTER, eps, max_spins, num_programs, num_counters,
    ROW_BLOCKS, O_COLS, NORM_TASKS, GATE_COLS, DOWN_COLS, CHUNKS: tl.constexpr,
    HAS_O_BIAS: tl.constexpr, HAS_D_BIAS: tl.constexpr, TRACE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N_O: tl.constexpr, BLOCK_N_G: tl.constexpr,
    BLOCK_N_D: tl.constexpr, BLOCK_K: tl.constexpr, DOWN_CHUNK: tl.constexpr,
    NORM_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_HA: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr,
    DYNAMIC: tl.constexpr, DOT_IN_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program's share of the tasks (module docstring). Buffers: x1, h2 (M, HIDDEN),
    act (M, INTER), part (CHUNKS, M, HIDDEN) float32, all contiguous; counters laid out as
    :attr:`TailPlan.counters` says."""
    o_done = counter_ptr + 2  # [ROW_BLOCKS]; [0] is the queue, [1] the exits
    n_done = o_done + ROW_BLOCKS  # [ROW_BLOCKS]
    g_done = n_done + ROW_BLOCKS  # [ROW_BLOCKS, CHUNKS]
    d_done = g_done + ROW_BLOCKS * CHUNKS  # [ROW_BLOCKS]
    start_n = ROW_BLOCKS * O_COLS
    start_g = start_n + NORM_TASKS
    start_d = start_g + ROW_BLOCKS * GATE_COLS
    start_r = start_d + ROW_BLOCKS * CHUNKS * DOWN_COLS
    total = start_r + NORM_TASKS
    if DYNAMIC:
        task = tl.atomic_add(counter_ptr, 1)
    else:
        task = tl.program_id(0)
    while task < total:
        if TRACE:
            began = _clock()
            began_global = _global_time()
        if task < start_n:
            _o_task(
                task, attn_ptr, attn_stride, x_ptr, x_stride, wo_ptr, wo_stride, bo_ptr,
                x1_ptr, o_done, M, HIDDEN, HA, O_COLS, HAS_O_BIAS, BLOCK_M, BLOCK_N_O,
                BLOCK_K, EVEN_HA, DOT_IN_FP32, PRECISION,
            )  # fmt: skip
        elif task < start_g:
            _norm_task(
                task - start_n, x1_ptr, post_w_ptr, h2_ptr, o_done, n_done, error_ptr, M,
                HIDDEN, O_COLS, eps, max_spins, NORM_ROWS, BLOCK_M, BLOCK_H,
            )  # fmt: skip
        elif task < start_d:
            _gate_up_task(
                task - start_g, h2_ptr, wgu_ptr, wgu_stride, act_ptr, n_done, g_done,
                error_ptr, M, HIDDEN, INTER, GATE_COLS, CHUNKS, max_spins, NORM_ROWS, BLOCK_M,
                BLOCK_N_G, BLOCK_K, DOWN_CHUNK, EVEN_H, DOT_IN_FP32, PRECISION,
            )  # fmt: skip
        elif task < start_r:
            _down_task(
                task - start_d, act_ptr, wd_ptr, wd_stride, part_ptr, g_done, d_done,
                error_ptr, M, HIDDEN, INTER, CHUNKS, DOWN_COLS, max_spins, BLOCK_M,
                BLOCK_N_D, BLOCK_N_G, BLOCK_K, DOWN_CHUNK, EVEN_I, DOT_IN_FP32, PRECISION,
            )  # fmt: skip
        else:
            _reduce_task(
                task - start_r, part_ptr, x1_ptr, bd_ptr, next_w_ptr, x_out_ptr, h_out_ptr,
                o_done, d_done, error_ptr, M, HIDDEN, O_COLS, DOWN_COLS, eps, max_spins,
                HAS_D_BIAS, NORM_ROWS, BLOCK_M, BLOCK_H, CHUNKS,
            )  # fmt: skip
        if TRACE:  # (global ns at start, SM cycles taken, SM id) of each task
            tl.store(trace_ptr + task * 3, began_global)
            tl.store(trace_ptr + task * 3 + 1, _clock() - began)
            tl.store(trace_ptr + task * 3 + 2, _sm_id().to(tl.int64))
        if DYNAMIC:
            task = tl.atomic_add(counter_ptr, 1)
        else:
            task += num_programs

    # The last program out zeroes the counters for the next launch.
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        for start in range(0, num_counters, 1024):
            offs = start + tl.arange(0, 1024)
            tl.store(counter_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < num_counters)


_HELPERS = (
    "_wait", "_signal", "_tile_dot", "_gate_up_dot", "_rms_norm_rows", "_clock",
    "_global_time", "_sm_id",
    "_o_task", "_norm_task", "_gate_up_task", "_down_task", "_reduce_task",
)  # fmt: skip


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernel jitted once, its helpers first (the kernel resolves them by name when it
    is compiled; interpreted when TRITON_INTERPRET is on now)."""
    for name in _HELPERS:
        globals()[name] = jit(globals()[name])
    kernel = jit(_layer_tail_kernel)
    return SimpleNamespace(layer_tail=kernel, interpreted=is_interpreted(kernel))


def layer_tail(
    attn: torch.Tensor,
    x: torch.Tensor,
    weights: TailWeights,
    eps: float,
    workspace: TailWorkspace,
    *,
    config: TailConfig | None = None,
    programs: int | None = None,
    max_spins: int = MAX_SPINS,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_out, h_out) of one decoder layer from its attention output, in one launch.

    attn (M, heads * head_dim) the attention's output rows; x (M, hidden) the residual
    stream entering the layer; both unit column stride. Returns x_out (M, hidden), the
    residual stream leaving the layer, and h_out, its next norm (the next layer's input
    norm, or the final norm), as ``fused_ops.add_rms_norm`` twice around the MLP would.
    ``programs``: the grid (default: ``config.programs_per_sm`` per SM, at most one per
    task; one in the interpreter with a fixed share). ``trace`` (GPU only; int64, 3 per
    task): each task's global start time (ns), SM cycles taken and SM id, for benchmarks.
    """
    m, heads_dim = attn.shape
    hidden, inter = x.shape[1], weights.gate_up_weight.shape[0] // 2
    _check(attn, x, weights, hidden, inter, heads_dim)
    config = config or default_config(m, hidden)
    x_out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(x_out)
    if m == 0:
        return x_out, h_out
    p = plan(m, hidden, inter, config)
    assert p.counters <= workspace.counters.numel(), "workspace too small for this many rows"
    total = p.offsets[-1]
    kernels = _kernels()
    if kernels.interpreted and not config.dynamic and programs is None:
        programs = 1  # the interpreter runs programs one after another: a fixed share
        # of tasks would wait on a program not yet started
    grid = min(programs or sm_count(x.device) * config.programs_per_sm, total)
    x1 = torch.empty_like(x_out)
    h2 = torch.empty_like(x_out)
    act = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    parts = torch.empty((p.chunks, m, hidden), dtype=torch.float32, device=x.device)
    w = weights
    kernels.layer_tail[(grid,)](
        attn, attn.stride(0), x, x.stride(0),
        w.o_weight, w.o_weight.stride(0), w.o_bias if w.o_bias is not None else x,
        w.post_norm_weight, w.gate_up_weight, w.gate_up_weight.stride(0),
        w.down_weight, w.down_weight.stride(0), w.down_bias if w.down_bias is not None else x,
        w.next_norm_weight, x1, h2, act, parts, x_out, h_out,
        workspace.counters, workspace.errors, trace if trace is not None else workspace.errors,
        m, hidden, heads_dim, inter, eps, max_spins, grid, p.counters,
        p.row_blocks, p.o_cols, p.norm_tasks, p.gate_cols, p.down_cols, p.chunks,
        HAS_O_BIAS=w.o_bias is not None, HAS_D_BIAS=w.down_bias is not None,
        TRACE=trace is not None,
        BLOCK_M=config.block_m, BLOCK_N_O=config.block_n_o, BLOCK_N_G=config.block_n_gate,
        BLOCK_N_D=config.block_n_down, BLOCK_K=config.block_k, DOWN_CHUNK=config.down_chunk,
        NORM_ROWS=config.norm_rows, BLOCK_H=_next_power_of_2(hidden),
        EVEN_HA=heads_dim % config.block_k == 0, EVEN_H=hidden % config.block_k == 0,
        EVEN_I=inter % config.block_k == 0,
        DYNAMIC=config.dynamic,
        DOT_IN_FP32=kernels.interpreted and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return x_out, h_out


def _check(attn, x, weights: TailWeights, hidden: int, inter: int, heads_dim: int) -> None:
    assert attn.dim() == 2 and x.dim() == 2 and attn.shape[0] == x.shape[0], "(M, *) rows"
    assert attn.stride(1) == 1 and x.stride(1) == 1, "attn and x need unit column strides"
    w = weights
    assert w.o_weight.shape == (hidden, heads_dim), f"o_weight {tuple(w.o_weight.shape)}"
    assert w.gate_up_weight.shape == (2 * inter, hidden), "gate_up_weight (2 * inter, hidden)"
    assert w.down_weight.shape == (hidden, inter), f"down_weight {tuple(w.down_weight.shape)}"
    for t in (w.o_weight, w.gate_up_weight, w.down_weight):
        assert t.stride(1) == 1 and t.dtype == x.dtype, "weights: unit column stride, x's dtype"
    for t in (w.post_norm_weight, w.next_norm_weight, w.o_bias, w.down_bias):
        assert t is None or (t.shape == (hidden,) and t.is_contiguous()), "(hidden,) vectors"


def layer_tail_reference(
    attn: torch.Tensor, x: torch.Tensor, weights: TailWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the unfused decoder computes: o_proj, add + norm, gate/up, SiLU x up (silu.py's
    rounding), down_proj, add + next norm."""
    from services.rollout.fused_ops import add_rms_norm

    w = weights
    o = torch.nn.functional.linear(attn, w.o_weight, w.o_bias)
    x1, h2 = add_rms_norm(x, o, w.post_norm_weight, eps)
    gate_up = torch.nn.functional.linear(h2, w.gate_up_weight).float()
    gate, up = gate_up.chunk(2, dim=-1)
    act = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)
    down = torch.nn.functional.linear(act, w.down_weight, w.down_bias)
    return add_rms_norm(x1, down, w.next_norm_weight, eps)
