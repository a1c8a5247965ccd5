"""Grouped-query flash-decoding over one layer's static KV cache (Triton, CUDA).

The torch path of :meth:`StaticDecoder.decode` runs six or more kernels of attention per
layer (two batched matmuls, the masked softmax, and the copies matmul makes of the
non-contiguous ``k_cache[i, :bs, :, :width]`` views). :func:`decode_attention` is one: one
program per (row, kv head) serves the kv head's g query heads as the rows of one
``tl.dot`` over the cache view in place (any strides), with an online softmax in float32.
For few rows it can split the keys of a row over several programs and reduce the partial
results in a second kernel, so that the GPU has enough programs to fill it.

:func:`decode_attention_rope` is the same kernel with :func:`rope_store`'s work done in it:
each program rotates its query heads and the row's new key itself, the program whose keys
hold the new position stores the new key/value into the cache and counts them as one more
key of its softmax from registers (no program reads a cache entry this launch writes), so
a decode step runs one launch per layer instead of two.

Grids depend only on shapes and ``width``, never on the values of ``lengths`` (or
positions), and nothing syncs with the host: a CUDA graph captured once replays with new
positions.

Precision: scores, softmax statistics and the output accumulator in float32, the softmax
weights rounded to the values' dtype for the second product (as the torch path rounds its
probabilities), outputs in the model dtype. The torch path also rounds the scores to the
model dtype out of its matmul; here they stay float32, so bf16 outputs differ from it by
about a bf16 ulp of the scores' effect. Float32 models use full-precision (not TF32) dots,
as torch.matmul does by default.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.rollout.fast.fused_ops import masked_softmax
from services.rollout.fast.kernels.runtime import (
    cdiv,
    check_head_dim,
    is_interpreted,
    jit,
    sm_count,
    tl,
    triton,
)

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


@dataclass(frozen=True)
class AttentionLaunch:
    """How the attention kernel is launched: keys per loop iteration, warps, software
    pipeline stages. ``benchmarks/rollout/attention.py`` times the choices on a GPU."""

    block_keys: int = BLOCK_KEYS
    num_warps: int = 4
    # 3 stages: 1.08x and 1.13x over 2 at widths 512 and 1,024 (256 rows, H200). Other
    # blocks, warps, stages, key splits, or keys loaded as stored then transposed: no
    # better (benchmarks/results/rollout_attention_launch_sweep_2026-11-29.json).
    num_stages: int = 3


LAUNCH = AttentionLaunch()
"""The launch every call uses (a module setting, so captured graphs keep one)."""


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
    new_k_ptr,
    new_k_stride_row,
    new_k_stride_head,
    new_k_stride_dim,
    new_v_ptr,
    new_v_stride_row,
    new_v_stride_head,
    new_v_stride_dim,
    cos_ptr,
    sin_ptr,
    table_stride_pos,
    table_stride_dim,
    table_len,
    cache_len,
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
    ROPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, kv head, split): the kv head's GROUPS query heads against keys
    [split * keys_per_split, ...) of the row's slot, up to min(lengths[row], width).

    ROPE=False: q is rotated already and every key is in the cache (the new_k ... cache_len
    arguments are not read).
    ROPE=True (:func:`decode_attention_rope`): lengths_ptr holds each row's position p
    instead (its length is p + 1); q and the new key new_k[row] are un-rotated, rotated here
    by the cos/sin tables' row p (rope_store's math). Cache keys [0, min(p, width)) are read;
    the program whose split holds min(p, width - 1) stores the rotated key and new_v[row] at
    position p of the slot (if 0 <= p < cache_len) and, if p < width, takes them from
    registers as key p of its last block (same block max and weight rounding as if read from
    the cache). The cache entry written here is never read by this launch.

    SPLIT=False: writes the normalized output in out's dtype (out (bs, H, d)).
    SPLIT=True: writes the split's normalized float32 output (out (bs, H, splits, d)) and its
    log2-sum-exp2 of scaled scores (lse (bs, H, splits)) for _combine_splits_kernel.
    """
    # int64 before any stride product: slot * slot stride overflows int32 on a large cache.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    begin = split * keys_per_split

    group_row = tl.arange(0, GROUP_ROWS)
    head = kv_head * GROUPS + group_row  # query heads of this kv head (and padding rows)
    head_ok = group_row < GROUPS
    dim = tl.arange(0, HEAD_DIM)
    key_in_block = tl.arange(0, BLOCK_N)

    q_rows = q_ptr + row * q_stride_row + head[:, None] * q_stride_head  # (GROUP_ROWS, 1)
    k_base = k_ptr + row * k_stride_slot + kv_head * k_stride_head
    v_base = v_ptr + row * v_stride_slot + kv_head * v_stride_head
    if ROPE:
        position = tl.load(lengths_ptr + row).to(tl.int64)
        # decode_attention's length min(p + 1, width), and the keys the cache holds before
        # the new one. A row at p >= width (a finished slot still stepping) attends keys
        # [0, width) of the cache, as decode_attention with lengths clamped to width does;
        # its new key is stored (if p < cache_len) but not attended.
        length = tl.minimum(tl.maximum(position + 1, 0), width).to(tl.int32)
        cached = tl.minimum(tl.maximum(position, 0), width).to(tl.int32)
        # The split that stores the new key: the one holding it, or (p >= width) the last.
        anchor = tl.minimum(position, width - 1)
        owner = (begin <= anchor) & (anchor < begin + keys_per_split)
        fold = owner & (position >= 0) & (position < width)
        position_lanes = position + tl.zeros([HEAD_DIM], tl.int64)

        # rope_store's rope: x * cos + rotate_half(x) * sin in float32 (products rounded
        # each, no FMA: the launch turns fp fusion off), rounded once to the model dtype.
        # Element i pairs with element i +- d/2; a position past the table reads zeros.
        low = dim < HEAD_DIM // 2
        partner = tl.where(low, dim + HEAD_DIM // 2, dim - HEAD_DIM // 2)
        in_table = (position_lanes >= 0) & (position_lanes < table_len)
        cos_at = tl.load(
            cos_ptr + position * table_stride_pos + dim * table_stride_dim,
            mask=in_table,
            other=0.0,
        ).to(tl.float32)
        sin_at = tl.load(
            sin_ptr + position * table_stride_pos + dim * table_stride_dim,
            mask=in_table,
            other=0.0,
        ).to(tl.float32)

        x = tl.load(q_rows + dim[None, :] * q_stride_dim, mask=head_ok[:, None], other=0.0)
        x = x.to(tl.float32)
        x_partner = tl.load(
            q_rows + partner[None, :] * q_stride_dim, mask=head_ok[:, None], other=0.0
        ).to(tl.float32)
        q = tl.where(
            low[None, :],
            x * cos_at[None, :] - x_partner * sin_at[None, :],
            x * cos_at[None, :] + x_partner * sin_at[None, :],
        ).to(q_ptr.dtype.element_ty)  # (GROUP_ROWS, HEAD_DIM)

        new_k_row = new_k_ptr + row * new_k_stride_row + kv_head * new_k_stride_head
        x = tl.load(new_k_row + dim * new_k_stride_dim).to(tl.float32)
        x_partner = tl.load(new_k_row + partner * new_k_stride_dim).to(tl.float32)
        new_key = tl.where(
            low, x * cos_at - x_partner * sin_at, x * cos_at + x_partner * sin_at
        ).to(k_ptr.dtype.element_ty)  # (HEAD_DIM,), as rope_store stores it
        new_value = tl.load(
            new_v_ptr
            + row * new_v_stride_row
            + kv_head * new_v_stride_head
            + dim * new_v_stride_dim
        )
    else:
        length = tl.minimum(tl.load(lengths_ptr + row).to(tl.int32), width)
        q = tl.load(q_rows + dim[None, :] * q_stride_dim, mask=head_ok[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    end = tl.minimum(begin + keys_per_split, length)
    if ROPE:
        # Blocks as decode_attention's over [begin, end), keys read from the cache only
        # below `cached`: the new key (at `cached` when folded) comes from registers, its
        # score (float32) in the max and the weights of its block like any key's.
        cache_end = tl.minimum(end, cached)
        new_score = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], 1) * scale_log2
        new_value_f32 = new_value.to(tl.float32)
    else:
        cache_end = end

    running_max = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    for start in range(begin, end, BLOCK_N):
        key = start + key_in_block
        key_ok = key < cache_end
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
        block_max = tl.max(scores, 1)
        if ROPE:
            # The new key's block is the owner's last (the loop ends at p + 1): -inf elsewhere.
            block_new_score = tl.where(
                fold & (position < start + BLOCK_N), new_score, float("-inf")
            )
            block_max = tl.maximum(block_max, block_new_score)
        # Finite: key `begin` is valid (from the cache, or the new key).
        new_max = tl.maximum(running_max, block_max)
        rescale = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        block_sum = tl.sum(weights, 1)
        if ROPE:
            new_weight = tl.exp2(block_new_score - new_max)  # 0 outside its block
            block_sum += new_weight
        running_sum = running_sum * rescale + block_sum
        # Weights rounded to the values' dtype for the second dot, as flash attention does.
        weights = weights.to(values.dtype)
        if DOT_IN_FP32:
            weights = weights.to(tl.float32)
            values = values.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=DOT_PRECISION)
        if ROPE:
            new_weight = new_weight.to(new_value.dtype).to(tl.float32)
            acc += new_weight[:, None] * new_value_f32[None, :]
        running_max = new_max

    if ROPE:
        # Stored once per (row, kv head), by the owner; never past the slot (rope_store's
        # rule: a position outside [0, cache_len) writes nothing). In lanes: the interpreter
        # turns a scalar bool & a vector of bools into int64, which no mask may be.
        anchor_lanes = tl.minimum(position_lanes, width - 1)
        keep = (anchor_lanes >= begin) & (anchor_lanes < begin + keys_per_split)
        keep = keep & (position_lanes >= 0) & (position_lanes < cache_len)
        tl.store(k_base + position * k_stride_pos + dim * k_stride_dim, new_key, mask=keep)
        tl.store(v_base + position * v_stride_pos + dim * v_stride_dim, new_value, mask=keep)

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


@functools.cache
def _kernels() -> SimpleNamespace:
    """The two kernels, jitted once (interpreted when TRITON_INTERPRET is on now)."""
    attention = jit(_decode_attention_kernel)
    return SimpleNamespace(
        attention=attention,
        combine_splits=jit(_combine_splits_kernel),
        interpreted=is_interpreted(attention),
    )


def split_count(programs: int, width: int, sms: int) -> int:
    """How many programs share each (row, kv head)'s keys: 1 when ``programs`` (rows x kv
    heads) already fill the GPU, else enough for about two programs per SM, each with at
    least KEYS_PER_SPLIT_MIN keys. Depends only on shapes, so a captured graph keeps it."""
    if programs >= sms:
        return 1
    wanted = cdiv(2 * sms, programs)
    most = max(1, width // KEYS_PER_SPLIT_MIN)
    return max(1, min(wanted, most, MAX_SPLITS))


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
    _check_attention(q, k_cache, v_cache, lengths, width)
    return _launch(q, k_cache, v_cache, lengths, None, scaling, width, out, num_splits)


def decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaling: float,
    width: int,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`rope_store` then :func:`decode_attention` in one launch: rope of each row's new
    token, its key/value into the row's cache slot, attention over the slot.

    q (bs, H, d), k and v (bs, kvh, d), un-rotated, any strides (views of a fused qkv
    projection are fine); cos, sin (max_len, d) in the model dtype; positions (bs,) int64 on
    q's device; k_cache, v_cache (slots >= bs, kvh, L, d), one layer's, any strides.

    The same as ``q_rot = rope_store(q, k, v, cos, sin, positions, k_cache, v_cache)`` then
    ``decode_attention(q_rot, k_cache, v_cache, (positions + 1).clamp(max=width), scaling,
    width)``: rope in float32 without FMA, rounded once to the model dtype (a position past
    the table reads zeros); rotated k and v stored at ``[s, :, positions[s]]`` (nothing for
    a position outside [0, L)); row s attends keys 0..positions[s], its new key included,
    or, at positions[s] >= width (a finished slot still stepping), keys 0..width-1 only,
    its new key stored but not attended. Outputs equal the two launches' up to float32
    rounding order (the new key's score is a sum of products, not part of a block's dot).
    ``num_splits`` as :func:`decode_attention`'s. Returns o (bs, H, d) in q's dtype.
    """
    bs, num_heads, d = q.shape
    kv_heads = k.shape[1]
    _check_attention(q, k_cache, v_cache, positions, width)
    assert k.shape == v.shape == (bs, kv_heads, d) and k_cache.shape[1] == kv_heads
    assert q.dtype == k.dtype == v.dtype, "q, k and v must share a dtype"
    assert cos.shape == sin.shape and cos.shape[-1] == d and cos.stride() == sin.stride()
    rope = (
        k,
        *k.stride(),
        v,
        *v.stride(),
        cos,
        sin,
        *cos.stride(),
        cos.shape[0],
        k_cache.shape[2],
    )
    return _launch(q, k_cache, v_cache, positions, rope, scaling, width, None, num_splits)


def _check_attention(q, k_cache, v_cache, lengths, width) -> None:
    bs, num_heads, d = q.shape
    slots, kv_heads, slot_len, _ = k_cache.shape
    check_head_dim(d)
    assert num_heads % kv_heads == 0, f"{num_heads} query heads over {kv_heads} kv heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[-1] == d
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must share a dtype"
    assert slots >= bs and 1 <= width <= slot_len, f"width {width}, slots {slots}, rows {bs}"
    assert lengths.shape == (bs,) and not lengths.dtype.is_floating_point


def _launch(q, k_cache, v_cache, lengths, rope, scaling, width, out, num_splits):
    """The attention kernel (and the combine kernel if split) over (bs, kvh, splits). With
    ``rope`` (:func:`decode_attention_rope`'s k, v, their strides, cos, sin, the tables'
    strides and length, L) the kernel's ROPE is on and ``lengths`` holds positions."""
    bs, num_heads, d = q.shape
    kv_heads = k_cache.shape[1]
    groups = num_heads // kv_heads
    with_rope = rope is not None
    if rope is None:  # the new-key and table arguments are not read: any pointer, zeros
        rope = (q, 0, 0, 0, q, 0, 0, 0, q, q, 0, 0, 0, 0)
    if out is None:
        out = torch.empty((bs, num_heads, d), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"
    kernels = _kernels()
    programs = bs * kv_heads
    launch = LAUNCH
    splits = num_splits or split_count(programs, width, sm_count(q.device))
    # Whole blocks per split; drop splits that could never hold a key.
    block = launch.block_keys
    keys_per_split = cdiv(cdiv(width, splits), block) * block
    splits = cdiv(width, keys_per_split)
    group_rows = max(MIN_GROUP_ROWS, triton.next_power_of_2(groups))
    constants = dict(
        GROUPS=groups,
        GROUP_ROWS=group_rows,
        HEAD_DIM=d,
        BLOCK_N=block,
        SPLIT=splits > 1,
        ROPE=with_rope,
        # The interpreter's tl.dot multiplies bfloat16 as raw uint16 bits: give it float32
        # operands there (exact: a product of two bf16 is exact in float32, the sum is
        # float32 either way). On a GPU bf16/fp16 go to the tensor cores as they are.
        DOT_IN_FP32=kernels.interpreted and q.dtype == torch.bfloat16,
        # float32 models: full-precision dots, as torch.matmul (TF32 off by default) does.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if with_rope:
        # No fused multiply-adds in the rope (rope_store's rule, so both agree bit for bit);
        # the whole kernel goes without: a few more float32 roundings in the softmax.
        constants["enable_fp_fusion"] = False
    common = (
        q,
        *q.stride(),
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        lengths,
        *rope,
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
