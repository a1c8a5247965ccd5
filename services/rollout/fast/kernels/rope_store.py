"""Rotary embedding of each row's new token and its key/value into the cache, one launch
(Triton, CUDA): replaces rope (five kernels per tensor in eager torch) and the two
``index_put`` scatters of the torch decode path.

The prefill uses it too, with a row per prompt token (prompts packed back to back): each
row then names the slot(s) it is stored in (a prompt sampled n times is stored in n slots)
and the rotated keys also come back for the prefill's own attention.

Rope is computed in float32 without fused multiply-adds and rounded once to the model dtype
(as the ``torch.compile``-fused ``fused_ops.rope`` computes it; the eager one rounds each
product too, which can move bf16 results by an ulp or so of the inputs).
"""

from __future__ import annotations

import functools

import torch

from services.rollout.fast.fused_ops import rope
from services.rollout.fast.kernels.runtime import cdiv, check_head_dim, jit, tl


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
    slots_ptr,
    slots_stride_row,
    slots_stride_copy,
    copies,
    k_out_ptr,
    k_out_stride_row,
    k_out_stride_head,
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
    rows,
    Q_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    SLOT_TABLE: tl.constexpr,
    K_OUT: tl.constexpr,
    ROWS: tl.constexpr,
):
    """ROWS rows of one head: heads [0, Q_HEADS) are query heads (rotated into q_out), the rest
    kv heads (key rotated, key and value stored at the row's position of slot `row`, or,
    with SLOT_TABLE, of each slot `slots[row, c]` >= 0 for c < copies; with K_OUT the
    rotated key also goes to k_out[row, head])."""
    head = tl.program_id(1)
    for r in tl.static_range(ROWS):
        # The last program's spare iterations redo the last row: the same values again.
        row = tl.minimum(tl.program_id(0) * ROWS + r, rows - 1).to(tl.int64)
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
        cos_high = tl.load(cos_row + high * table_stride_dim, mask=in_table, other=0.0).to(
            tl.float32
        )
        sin_low = tl.load(sin_row + low * table_stride_dim, mask=in_table, other=0.0).to(tl.float32)
        sin_high = tl.load(sin_row + high * table_stride_dim, mask=in_table, other=0.0).to(
            tl.float32
        )

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
            cache_dtype = k_cache_ptr.dtype.element_ty
            rotated_low = (x_low * cos_low - x_high * sin_low).to(cache_dtype)
            rotated_high = (x_high * cos_high + x_low * sin_high).to(cache_dtype)
            src = v_ptr + row * v_stride_row + kv_head * v_stride_head
            value_low = tl.load(src + low * v_stride_dim)
            value_high = tl.load(src + high * v_stride_dim)
            if K_OUT:
                dst = k_out_ptr + row * k_out_stride_row + kv_head * k_out_stride_head
                tl.store(dst + low, rotated_low)
                tl.store(dst + high, rotated_high)
            for c in range(copies):
                if SLOT_TABLE:
                    slot = tl.load(slots_ptr + row * slots_stride_row + c * slots_stride_copy)
                else:
                    slot = row
                slot_lanes = slot + tl.zeros([HALF_DIM], tl.int64)
                keep = in_slot & (slot_lanes >= 0)  # -1: no slot in this column of the table
                slot = tl.maximum(slot, 0)
                dst = (
                    k_cache_ptr
                    + slot * k_cache_stride_slot
                    + kv_head * k_cache_stride_head
                    + position * k_cache_stride_pos
                )
                tl.store(dst + low * k_cache_stride_dim, rotated_low, mask=keep)
                tl.store(dst + high * k_cache_stride_dim, rotated_high, mask=keep)
                dst = (
                    v_cache_ptr
                    + slot * v_cache_stride_slot
                    + kv_head * v_cache_stride_head
                    + position * v_cache_stride_pos
                )
                tl.store(dst + low * v_cache_stride_dim, value_low, mask=keep)
                tl.store(dst + high * v_cache_stride_dim, value_high, mask=keep)


@functools.cache
def _kernel():
    return jit(_rope_store_kernel)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of the new token of each row, and its key/value into the cache.

    q (bs, H, d), k and v (bs, kvh, d), any strides (views of a fused qkv projection are
    fine); cos, sin (max_len, d) in the model dtype (``StaticDecoder.rope_table``);
    positions (bs,) int64 on q's device; k_cache, v_cache (slots >= bs, kvh, L, d), one
    layer's, any strides. Writes rotated k to ``k_cache[s, :, positions[s]]`` and v to
    ``v_cache[s, :, positions[s]]``. A position outside [0, L) writes nothing (and one past
    the table reads no table: that row's q is zeros), never out of bounds. Rope is computed
    in float32 and rounded once. Returns rotated q, a new contiguous (bs, H, d) tensor.

    ``slots`` (bs, C) int64 (prefill: a row per prompt token): row s is stored in slots
    ``slots[s, c]`` for every c with ``slots[s, c] >= 0`` instead of in slot s (the cache
    may then have fewer slots than rows). ``k_out`` (bs, kvh, d), last dim contiguous, also
    receives the rotated keys.
    """
    bs, num_heads, d = q.shape
    kv_heads = k.shape[1]
    check_head_dim(d)
    assert k.shape == v.shape == (bs, kv_heads, d)
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    assert cos.shape == sin.shape and cos.shape[-1] == d and cos.stride() == sin.stride()
    assert k_cache.shape == v_cache.shape and (slots is not None or k_cache.shape[0] >= bs)
    assert k_cache.shape[1] == kv_heads and k_cache.shape[-1] == d
    assert positions.shape == (bs,) and not positions.dtype.is_floating_point
    if slots is not None:
        assert slots.dim() == 2 and slots.shape[0] == bs and slots.dtype == torch.int64
    if k_out is not None:
        assert k_out.shape == k.shape and k_out.dtype == k.dtype and k_out.stride(-1) == 1
    q_out = torch.empty((bs, num_heads, d), dtype=q.dtype, device=q.device)
    slot_table = slots if slots is not None else positions  # any pointer: not read
    keys_out = k_out if k_out is not None else q_out  # any pointer: not written
    # A prefill has a row per prompt token: many rows a program, not one program (one warp)
    # for each of hundreds of thousands of (row, head) pairs.
    rows_per_program = 1 if bs <= 1024 else 16
    _kernel()[(cdiv(bs, rows_per_program), num_heads + kv_heads)](
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
        slot_table,
        slots.stride(0) if slots is not None else 0,
        slots.stride(1) if slots is not None else 0,
        slots.shape[1] if slots is not None else 1,
        keys_out,
        k_out.stride(0) if k_out is not None else 0,
        k_out.stride(1) if k_out is not None else 0,
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        q_out,
        q_out.stride(0),
        q_out.stride(1),
        k_cache.shape[2],
        bs,
        Q_HEADS=num_heads,
        HALF_DIM=d // 2,
        SLOT_TABLE=slots is not None,
        K_OUT=k_out is not None,
        ROWS=rows_per_program,
        # A (row, head) is d elements: one warp covers it.
        num_warps=1,
        # No fused multiply-adds: x_low * cos - x_high * sin rounds each product as torch's
        # float32 rope does (and as the interpreter does), so all three agree bit for bit.
        enable_fp_fusion=False,
    )
    return q_out


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
