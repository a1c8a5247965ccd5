"""Triton kernels for the decode step of the static-KV-cache engine (CUDA).

A decode step at a few hundred rows is bound by kernel count, not bytes. Per layer, the
torch path of :meth:`StaticDecoder.decode` runs six or more kernels of attention (two
batched matmuls, the masked softmax, and the copies matmul makes of the non-contiguous
``k_cache[i, :bs, :, :width]`` views) plus rope and two ``index_put`` scatters into the
cache. Here that is two launches:

- :func:`rope_store` rotates q and k at each row's position, writes the rotated key and the
  raw value into the row's cache slot, and returns the rotated q;
- :func:`decode_attention` is grouped-query flash-decoding over the cache view in place
  (any strides): one program per (row, kv head) serves the kv head's g query heads as the
  rows of one ``tl.dot``, with an online softmax in float32. For few rows it can also split
  the keys of a row over several programs and reduce the partial results in a second
  kernel, so that the GPU has enough programs to fill it.

Grids depend only on shapes and ``width``, never on the values of ``lengths`` or
``positions``, and nothing syncs with the host: a CUDA graph captured once replays with
new positions.

Precision: scores, softmax statistics and the output accumulator in float32, the softmax
weights rounded to the values' dtype for the second product (as the torch path rounds its
probabilities), outputs in the model dtype. The torch path also rounds the scores to the
model dtype out of its matmul; here they stay float32, so bf16 outputs differ from it by
about a bf16 ulp of the scores' effect. Float32 models use full-precision (not TF32) dots,
as torch.matmul does by default. Rope is computed in float32 without fused multiply-adds
and rounded once to the model dtype (as the ``torch.compile``-fused ``fused_ops.rope``
computes it; the eager one rounds each product too, which can move bf16 results by an ulp
or so of the inputs).

The pure-torch ``*_reference`` functions compute what ``decoder.py`` computes today; the
tests check the kernels against them with the Triton interpreter (``TRITON_INTERPRET=1``,
CPU tensors), which must be set before this module first launches a kernel.
"""

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace

import torch

from services.rollout.fused_ops import masked_softmax, rope

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU CI may not have triton: the module still imports
    triton = None
    tl = None

LOG2_E = math.log2(math.e)
BLOCK_KEYS = 64
"""Keys per iteration of the attention loop: a (64, d) tile of keys and one of values per
step (16 KiB each at d=128 in bf16), small enough for two pipeline stages and several
programs per SM, large enough that a row's loop is a handful of iterations."""
MIN_GROUP_ROWS = 16
"""tl.dot needs at least 16 rows: the g query heads of a kv head are padded up to this."""
MAX_SPLITS = 16
KEYS_PER_SPLIT_MIN = 4 * BLOCK_KEYS
"""A split is worth its second kernel and partial writes only with a few blocks of keys."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: triton imports and the device is
    CUDA, or the Triton interpreter is on (``TRITON_INTERPRET=1``; it runs CPU tensors)."""
    if triton is None:
        return False
    return _interpreting() or torch.device(device).type == "cuda"


# ---------------------------------------------------------------------------------------
# Kernels. Plain functions here, wrapped by triton.jit on first use (see _kernels), so the
# module imports without triton and the interpreter is chosen by the environment at the
# first launch rather than at import.
# ---------------------------------------------------------------------------------------


def _decode_attention_kernel(
    q_ptr,
    q_stride_row,
    q_stride_head,
    q_stride_dim,
    k_ptr,
    k_stride_slot,
    k_stride_head,
    k_stride_pos,
    k_stride_dim,
    v_ptr,
    v_stride_slot,
    v_stride_head,
    v_stride_pos,
    v_stride_dim,
    lengths_ptr,
    out_ptr,
    out_stride_row,
    out_stride_head,
    out_stride_split,
    out_stride_dim,
    lse_ptr,
    lse_stride_row,
    lse_stride_head,
    scale_log2,
    width,
    keys_per_split,
    GROUPS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, kv head, split): the kv head's GROUPS query heads against keys
    [split * keys_per_split, ...) of the row's slot, up to min(lengths[row], width).

    SPLIT=False: writes the normalized output in out's dtype (out (bs, H, d)).
    SPLIT=True: writes the split's normalized float32 output (out (bs, H, splits, d)) and its
    log2-sum-exp2 of scaled scores (lse (bs, H, splits)) for _combine_splits_kernel.
    """
    # int64 before any stride product: slot * slot stride overflows int32 on a large cache.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.minimum(tl.load(lengths_ptr + row).to(tl.int32), width)
    begin = split * keys_per_split
    end = tl.minimum(begin + keys_per_split, length)

    group_row = tl.arange(0, GROUP_ROWS)
    head = kv_head * GROUPS + group_row  # query heads of this kv head (and padding rows)
    head_ok = group_row < GROUPS
    dim = tl.arange(0, HEAD_DIM)
    key_in_block = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + row * q_stride_row + head[:, None] * q_stride_head + dim[None, :] * q_stride_dim,
        mask=head_ok[:, None],
        other=0.0,
    )  # (GROUP_ROWS, HEAD_DIM)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + row * k_stride_slot + kv_head * k_stride_head
    v_base = v_ptr + row * v_stride_slot + kv_head * v_stride_head

    running_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    for start in range(begin, end, BLOCK_N):
        key = start + key_in_block
        key_ok = key < end
        # Keys loaded transposed, (HEAD_DIM, BLOCK_N), so q @ keys needs no tl.trans.
        keys = tl.load(
            k_base + key[None, :] * k_stride_pos + dim[:, None] * k_stride_dim,
            mask=key_ok[None, :],
            other=0.0,
        )
        values = tl.load(
            v_base + key[:, None] * v_stride_pos + dim[None, :] * v_stride_dim,
            mask=key_ok[:, None],
            other=0.0,
        )  # (BLOCK_N, HEAD_DIM)
        if DOT_IN_FP32:
            keys = keys.to(tl.float32)
        # Scores in float32, scaled by scaling * log2(e) so exp2 gives exp(scores * scaling).
        scores = tl.dot(q, keys, input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))  # finite: key `begin` is valid
        rescale = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        # Weights rounded to the values' dtype for the second dot, as flash attention does.
        weights = weights.to(values.dtype)
        if DOT_IN_FP32:
            weights = weights.to(tl.float32)
            values = values.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=DOT_PRECISION)
        running_max = new_max

    # An empty range (a split past the row's length) leaves sum 0: write zeros, not 0/0.
    safe_sum = tl.where(running_sum > 0.0, running_sum, 1.0)
    o = acc / safe_sum[:, None]
    out_ptrs = (
        out_ptr
        + row * out_stride_row
        + head[:, None] * out_stride_head
        + split * out_stride_split
        + dim[None, :] * out_stride_dim
    )
    if SPLIT:
        tl.store(out_ptrs, o, mask=head_ok[:, None])
        lse = tl.where(running_sum > 0.0, running_max + tl.log2(safe_sum), float("-inf"))
        lse_ptrs = lse_ptr + row * lse_stride_row + head * lse_stride_head + split
        tl.store(lse_ptrs, lse, mask=head_ok)
    else:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def _combine_splits_kernel(
    part_ptr,
    part_stride_row,
    part_stride_head,
    part_stride_split,
    lse_ptr,
    lse_stride_row,
    lse_stride_head,
    out_ptr,
    out_stride_row,
    out_stride_head,
    out_stride_dim,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One (row, query head): the splits' outputs weighted by their share of the softmax."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_PAD)
    split_ok = split < SPLITS
    dim = tl.arange(0, HEAD_DIM)

    lse = tl.load(
        lse_ptr + row * lse_stride_row + head * lse_stride_head + split,
        mask=split_ok,
        other=float("-inf"),
    )
    top = tl.max(lse, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no -inf - -inf even with no keys at all
    share = tl.exp2(lse - top)  # 0 for empty and padding splits
    parts = tl.load(
        part_ptr
        + row * part_stride_row
        + head * part_stride_head
        + split[:, None] * part_stride_split
        + dim[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # (SPLITS_PAD, HEAD_DIM) float32
    total = tl.sum(share, 0)
    total = tl.where(total > 0.0, total, 1.0)
    o = tl.sum(parts * share[:, None], 0) / total
    tl.store(
        out_ptr + row * out_stride_row + head * out_stride_head + dim * out_stride_dim,
        o.to(out_ptr.dtype.element_ty),
    )


def _rope_store_kernel(
    q_ptr,
    q_stride_row,
    q_stride_head,
    q_stride_dim,
    k_ptr,
    k_stride_row,
    k_stride_head,
    k_stride_dim,
    v_ptr,
    v_stride_row,
    v_stride_head,
    v_stride_dim,
    cos_ptr,
    sin_ptr,
    table_stride_pos,
    table_stride_dim,
    table_len,
    positions_ptr,
    k_cache_ptr,
    k_cache_stride_slot,
    k_cache_stride_head,
    k_cache_stride_pos,
    k_cache_stride_dim,
    v_cache_ptr,
    v_cache_stride_slot,
    v_cache_stride_head,
    v_cache_stride_pos,
    v_cache_stride_dim,
    q_out_ptr,
    q_out_stride_row,
    q_out_stride_head,
    cache_len,
    Q_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
):
    """One (row, head): heads [0, Q_HEADS) are query heads (rotated into q_out), the rest
    kv heads (key rotated, key and value stored at the row's position of slot `row`)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + row)
    low = tl.arange(0, HALF_DIM)
    high = low + HALF_DIM

    position_lanes = position + tl.zeros([HALF_DIM], tl.int64)

    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x_high, x_low): in float32. A row
    # whose position is past the table (a finished slot still stepping) reads zeros, not
    # memory past the table: its output is garbage either way, its read stays in bounds.
    in_table = (position_lanes >= 0) & (position_lanes < table_len)
    cos_row = cos_ptr + position * table_stride_pos
    sin_row = sin_ptr + position * table_stride_pos
    cos_low = tl.load(cos_row + low * table_stride_dim, mask=in_table, other=0.0).to(tl.float32)
    cos_high = tl.load(cos_row + high * table_stride_dim, mask=in_table, other=0.0).to(tl.float32)
    sin_low = tl.load(sin_row + low * table_stride_dim, mask=in_table, other=0.0).to(tl.float32)
    sin_high = tl.load(sin_row + high * table_stride_dim, mask=in_table, other=0.0).to(tl.float32)

    if head < Q_HEADS:
        src = q_ptr + row * q_stride_row + head * q_stride_head
        x_low = tl.load(src + low * q_stride_dim).to(tl.float32)
        x_high = tl.load(src + high * q_stride_dim).to(tl.float32)
        dst = q_out_ptr + row * q_out_stride_row + head * q_out_stride_head
        out_dtype = q_out_ptr.dtype.element_ty
        tl.store(dst + low, (x_low * cos_low - x_high * sin_low).to(out_dtype))
        tl.store(dst + high, (x_high * cos_high + x_low * sin_high).to(out_dtype))
    else:
        kv_head = head - Q_HEADS
        # A position outside the slot is not written (index_put would trip a device assert;
        # an unmasked store would scribble over the next slot).
        in_slot = (position_lanes >= 0) & (position_lanes < cache_len)
        src = k_ptr + row * k_stride_row + kv_head * k_stride_head
        x_low = tl.load(src + low * k_stride_dim).to(tl.float32)
        x_high = tl.load(src + high * k_stride_dim).to(tl.float32)
        dst = (
            k_cache_ptr
            + row * k_cache_stride_slot
            + kv_head * k_cache_stride_head
            + position * k_cache_stride_pos
        )
        cache_dtype = k_cache_ptr.dtype.element_ty
        rotated_low = (x_low * cos_low - x_high * sin_low).to(cache_dtype)
        rotated_high = (x_high * cos_high + x_low * sin_high).to(cache_dtype)
        tl.store(dst + low * k_cache_stride_dim, rotated_low, mask=in_slot)
        tl.store(dst + high * k_cache_stride_dim, rotated_high, mask=in_slot)

        src = v_ptr + row * v_stride_row + kv_head * v_stride_head
        value_low = tl.load(src + low * v_stride_dim)
        value_high = tl.load(src + high * v_stride_dim)
        dst = (
            v_cache_ptr
            + row * v_cache_stride_slot
            + kv_head * v_cache_stride_head
            + position * v_cache_stride_pos
        )
        tl.store(dst + low * v_cache_stride_dim, value_low, mask=in_slot)
        tl.store(dst + high * v_cache_stride_dim, value_high, mask=in_slot)


def _silu_mul_halves_kernel(
    x_ptr,
    out_ptr,
    inter,
    x_stride_row,
    out_stride_row,
    BLOCK: tl.constexpr,
):
    """One (row, column block): out[row, c] = silu(x[row, c]) * x[row, inter + c]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < inter
    src = x_ptr + row * x_stride_row
    gate = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(src + inter + cols, mask=keep, other=0.0).to(tl.float32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride_row + cols, result.to(out_ptr.dtype.element_ty), mask=keep)


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernels, jitted once (interpreted when TRITON_INTERPRET is on at this point)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    attention = triton.jit(_decode_attention_kernel)
    return SimpleNamespace(
        attention=attention,
        combine_splits=triton.jit(_combine_splits_kernel),
        rope_store=triton.jit(_rope_store_kernel),
        silu_mul_halves=triton.jit(_silu_mul_halves_kernel),
        interpreted=type(attention).__name__ == "InterpretedFunction",
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's, so the interpreter picks what the GPU would


def split_count(programs: int, width: int, sm_count: int) -> int:
    """How many programs share each (row, kv head)'s keys: 1 when ``programs`` (rows x kv
    heads) already fill the GPU, else enough for about two programs per SM, each with at
    least KEYS_PER_SPLIT_MIN keys. Depends only on shapes, so a captured graph keeps it."""
    if programs >= sm_count:
        return 1
    wanted = _cdiv(2 * sm_count, programs)
    most = max(1, width // KEYS_PER_SPLIT_MIN)
    return max(1, min(wanted, most, MAX_SPLITS))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_head_dim(d: int) -> None:
    assert d >= 16 and d & (d - 1) == 0, f"head_dim must be a power of two >= 16, got {d}"


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    width: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Grouped-query attention of one new token per row over its slot of one layer's cache.

    q (bs, H, d) in the model dtype, H = kvh * g (query head h reads kv head h // g);
    k_cache, v_cache (slots >= bs, kvh, L, d), any strides (row s reads slot s); lengths (bs,)
    int64/int32 on q's device: row s attends keys 0..lengths[s]-1 (lengths >= 1, clamped to
    ``width``); ``width`` <= L bounds every length and, with the shapes, fixes the grid.
    ``num_splits`` (None: :func:`split_count`) splits each row's keys over that many programs.
    Returns o (bs, H, d) in q's dtype (written into ``out`` when given).
    """
    bs, num_heads, d = q.shape
    slots, kv_heads, slot_len, _ = k_cache.shape
    groups = num_heads // kv_heads
    _check_head_dim(d)
    assert num_heads == kv_heads * groups, f"{num_heads} query heads over {kv_heads} kv heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == d
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must share a dtype"
    assert slots >= bs and 1 <= width <= slot_len, f"width {width}, slots {slots}, rows {bs}"
    assert lengths.shape == (bs,) and not lengths.dtype.is_floating_point
    if out is None:
        out = torch.empty((bs, num_heads, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"
    kernels = _kernels()
    programs = bs * kv_heads
    splits = num_splits or split_count(programs, width, _sm_count(q.device))
    # Whole blocks per split; drop splits that could never hold a key.
    keys_per_split = _cdiv(_cdiv(width, splits), BLOCK_KEYS) * BLOCK_KEYS
    splits = _cdiv(width, keys_per_split)
    group_rows = max(MIN_GROUP_ROWS, triton.next_power_of_2(groups))
    constants = dict(
        GROUPS=groups,
        GROUP_ROWS=group_rows,
        HEAD_DIM=d,
        BLOCK_N=BLOCK_KEYS,
        SPLIT=splits > 1,
        # The interpreter's tl.dot multiplies bfloat16 as raw uint16 bits: give it float32
        # operands there (exact: a product of two bf16 is exact in float32, the sum is
        # float32 either way). On a GPU bf16/fp16 go to the tensor cores as they are.
        DOT_IN_FP32=kernels.interpreted and q.dtype == torch.bfloat16,
        # float32 models: full-precision dots, as torch.matmul (TF32 off by default) does.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    common = (
        q,
        *q.stride(),
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        lengths,
    )
    if splits == 1:
        kernels.attention[(bs, kv_heads, 1)](
            *common,
            out,
            out.stride(0),
            out.stride(1),
            0,
            out.stride(2),
            out,  # no lse: an unused pointer
            0,
            0,
            scaling * LOG2_E,
            width,
            keys_per_split,
            **constants,
        )
        return out
    parts = torch.empty((bs, num_heads, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, num_heads, splits), dtype=torch.float32, device=q.device)
    kernels.attention[(bs, kv_heads, splits)](
        *common,
        parts,
        *parts.stride(),
        lse,
        lse.stride(0),
        lse.stride(1),
        scaling * LOG2_E,
        width,
        keys_per_split,
        **constants,
    )
    kernels.combine_splits[(bs, num_heads)](
        parts,
        parts.stride(0),
        parts.stride(1),
        parts.stride(2),
        lse,
        lse.stride(0),
        lse.stride(1),
        out,
        *out.stride(),
        SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        HEAD_DIM=d,
        num_warps=4,
    )
    return out


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of the new token of each row, and its key/value into the cache.

    q (bs, H, d), k and v (bs, kvh, d), any strides (views of a fused qkv projection are
    fine); cos, sin (max_len, d) in the model dtype (``StaticDecoder.rope_table``);
    positions (bs,) int64 on q's device; k_cache, v_cache (slots >= bs, kvh, L, d), one
    layer's, any strides. Writes rotated k to ``k_cache[s, :, positions[s]]`` and v to
    ``v_cache[s, :, positions[s]]``. A position outside [0, L) writes nothing (and one past
    the table reads no table: that row's q is zeros), never out of bounds. Rope is computed
    in float32 and rounded once. Returns rotated q, a new contiguous (bs, H, d) tensor.
    """
    bs, num_heads, d = q.shape
    kv_heads = k.shape[1]
    _check_head_dim(d)
    assert k.shape == v.shape == (bs, kv_heads, d)
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    assert cos.shape == sin.shape and cos.shape[-1] == d and cos.stride() == sin.stride()
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] >= bs
    assert k_cache.shape[1] == kv_heads and k_cache.shape[-1] == d
    assert positions.shape == (bs,) and not positions.dtype.is_floating_point
    q_out = torch.empty((bs, num_heads, d), dtype=q.dtype, device=q.device)
    _kernels().rope_store[(bs, num_heads + kv_heads)](
        q,
        *q.stride(),
        k,
        *k.stride(),
        v,
        *v.stride(),
        cos,
        sin,
        *cos.stride(),
        cos.shape[0],
        positions,
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        q_out,
        q_out.stride(0),
        q_out.stride(1),
        k_cache.shape[2],
        Q_HEADS=num_heads,
        HALF_DIM=d // 2,
        # A (row, head) is d elements: one warp covers it.
        num_warps=1,
        # No fused multiply-adds: x_low * cos - x_high * sin rounds each product as torch's
        # float32 rope does (and as the interpreter does), so all three agree bit for bit.
        enable_fp_fusion=False,
    )
    return q_out


SILU_BLOCK = 1024


def silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2 * I) fused gate/up projection -> (rows, I) ``silu(gate) * up``, in float32
    and rounded once to the input dtype (as the compiled ``fused_ops.silu_mul_halves``).

    A plain 2-D grid of (row, column block): the ``torch.compile`` kernel of the same
    function, compiled for dynamic shapes, took 40 us a decode step at 256 rows on the
    H200 (it indexes the halves with divisions by a symbolic size), this one ~3 us.
    """
    rows, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, _cdiv(inter, SILU_BLOCK))
        _kernels().silu_mul_halves[grid](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK, num_warps=4
        )
    return out


# ---------------------------------------------------------------------------------------
# What decoder.py computes today, in torch: the kernels' references.
# ---------------------------------------------------------------------------------------


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    width: int,
) -> torch.Tensor:
    """:func:`decode_attention` as ``StaticDecoder.decode``'s "matmul" path: q (bs, H, d),
    caches (slots, kvh, L, d), lengths (bs,); returns o (bs, H, d) in q's dtype. Scores
    come out of the matmul in the model dtype, the softmax is float32."""
    bs, num_heads, d = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[:bs, :, :width]  # (bs, kvh, w, d)
    values = v_cache[:bs, :, :width]
    span = torch.arange(width, device=q.device)
    keep = (span[None, :] < lengths[:, None])[:, None, None, :]  # (bs, 1, 1, w)
    bias = torch.zeros(keep.shape, dtype=torch.float32, device=q.device)
    bias.masked_fill_(~keep, float("-inf"))
    grouped = q.reshape(bs, kv_heads, num_heads // kv_heads, d)  # (bs, kvh, g, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2))  # (bs, kvh, g, w)
    o = torch.matmul(masked_softmax(scores, scaling, bias, values.dtype), values)
    return o.reshape(bs, num_heads, d)


def rope_store_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """:func:`rope_store` as ``StaticDecoder.decode`` does it (rope in the model dtype, then
    two index_put scatters): q (bs, H, d), k, v (bs, kvh, d), cos, sin (max_len, d),
    positions (bs,), caches (slots, kvh, L, d) written in place; returns rotated q (bs, H, d)."""
    bs = q.shape[0]
    q, k = rope(q, k, cos[positions][:, None, :], sin[positions][:, None, :])
    rows = torch.arange(bs, device=q.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v
    return q.contiguous()


# ---------------------------------------------------------------------------------------
# Sampling: one pass over a decode step's (rows, vocabulary) logits.
# ---------------------------------------------------------------------------------------


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
    """Jitted apart from _kernels: its seed/step words change every call, and specializing
    on their values (== 1, divisible by 16) would compile new variants mid-run."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    return triton.jit(
        _sample_gumbel_kernel, do_not_specialize=["key_lo", "key_hi", "step_lo", "step_hi"]
    )


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
