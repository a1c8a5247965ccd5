"""decode_attention_rope (rope, cache write and attention in one launch) against the two
launches it replaces, rope_store then decode_attention, in the Triton interpreter (CPU).

As in test_decode_kernels.py, the interpreter is chosen when the kernels are first jitted,
so the checks run in one child process started with TRITON_INTERPRET=1; it writes each
case's outcome to a JSON file and each pytest item reads its own.

Both versions run in the interpreter on copies of the same caches, so they round alike
(including the interpreter's float32 -> bf16 truncation, see ONE_ULP in
test_decode_kernels.py); they differ only in float32 rounding order (the fused kernel
scores the new key with a sum of products after the loop, not inside a block's dot), which
can move a bf16/fp16 output by an ulp. The caches must come out bit-identical.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter_cases import needs_triton, report, run_cases, run_child

from services.rollout.fast import kernels as td

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
ONE_ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _case(dtype, H, kvh, d, L, width, positions, splits, layout, table_len) -> dict:
    """H query heads over kvh kv heads, head_dim d, slot length L of the cache view, width,
    one row per position, num_splits, the cache layout ("layer": one layer of a 5-D buffer;
    "sliced": the first L positions of longer slots, so a write at >= L would land in memory
    the test sees; "permuted": a (slots, L, kvh, d) buffer seen as (slots, kvh, L, d)) and
    the rope tables' length."""
    return dict(dtype=dtype, H=H, kvh=kvh, d=d, L=L, width=width, positions=positions,
                splits=splits, layout=layout, table_len=table_len)  # fmt: skip


# Every case has position 0 (the row attends only its new key), positions around the block
# boundary (63, 64, 65), a finished slot (width <= position < L: its key is stored, not
# attended), a position >= L (nothing stored) and, in most, one past the rope table (q and k
# rotate to zeros). With 3 splits of 64 keys (width 190), 64 and 128 are each the only key
# of their split, 63 the last of split 0, 190.. belong to no split (the last one stores).
CASES = {
    "fp32-g1-d64-split1-sliced": _case(
        "float32", 2, 2, 64, 160, 150, [0, 1, 63, 64, 65, 149, 150, 159, 160, 185], 1,
        "sliced", 180,
    ),
    "fp32-g7-d32-split3-layer": _case(
        "float32", 14, 2, 32, 200, 190, [0, 63, 64, 65, 128, 189, 190, 199, 200, 230], 3,
        "layer", 220,
    ),
    "bf16-g7-d64-split3-permuted": _case(
        "bfloat16", 14, 2, 64, 200, 190, [0, 63, 64, 65, 128, 189, 190, 199, 200, 230], 3,
        "permuted", 220,
    ),
    "bf16-g1-d32-split1-width-is-L": _case(
        "bfloat16", 3, 3, 32, 100, 100, [0, 63, 64, 65, 99, 100, 130], 1, "layer", 120
    ),
    "fp16-g2-d64-split2-sliced": _case(
        "float16", 4, 2, 64, 140, 128, [0, 63, 64, 127, 128, 139, 140, 170], 2, "sliced", 160
    ),
}  # fmt: skip


def _rope_tables(max_len: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_len, d) as a Llama rotary module makes them (base 10000)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _cache_buffer(layout: str, slots: int, kvh: int, L: int, d: int, dtype, gen):
    if layout == "layer":
        return torch.randn(3, slots, kvh, L, d, generator=gen).to(dtype)
    if layout == "sliced":
        return torch.randn(slots, kvh, L + 9, d, generator=gen).to(dtype)
    assert layout == "permuted"
    return torch.randn(slots, L, kvh, d, generator=gen).to(dtype)


def _view(layout: str, buffer: torch.Tensor, L: int) -> torch.Tensor:
    """One layer's (slots, kvh, L, d) cache view of a buffer."""
    if layout == "layer":
        return buffer[1]
    if layout == "sliced":
        return buffer[:, :, :L]
    return buffer.permute(0, 2, 1, 3)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(BITS[x.dtype])


def check_case(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor(case["positions"], dtype=torch.int64)
    bs, H, kvh, d, L, width = len(positions), case["H"], case["kvh"], case["d"], case["L"], case["width"]  # fmt: skip
    g, layout, splits = H // kvh, case["layout"], case["splits"]
    scaling = d**-0.5
    cos, sin = _rope_tables(case["table_len"], d, dtype)
    # q, k, v as views of one fused projection output (bs, (H + 2 kvh) * d).
    qkv = torch.randn(bs, (H + 2 * kvh) * d, generator=gen).to(dtype)
    qkv_before = qkv.clone()
    q = qkv[:, : H * d].view(bs, H, d)
    k = qkv[:, H * d : (H + kvh) * d].view(bs, kvh, d)
    v = qkv[:, (H + kvh) * d :].view(bs, kvh, d)

    # Two slots more than rows. NaN wherever the fused kernel must not read: in row s's slot
    # from min(position, width) on (its new key comes from registers; the two-launch version
    # overwrites it before reading it), and the slots past the batch. One NaN read poisons
    # the row's output.
    slots = bs + 2
    k_buffer = _cache_buffer(layout, slots, kvh, L, d, dtype, gen)
    v_buffer = _cache_buffer(layout, slots, kvh, L, d, dtype, gen)
    cached = torch.cat((positions.clamp(min=0, max=width), torch.zeros(2, dtype=torch.int64)))
    unread = torch.arange(L)[None, :] >= cached[:, None]  # (slots, L)
    for buffer in (k_buffer, v_buffer):
        _view(layout, buffer, L).masked_fill_(unread[:, None, :, None], float("nan"))
    k_two, v_two = k_buffer.clone(), v_buffer.clone()
    k_before = k_buffer.clone()

    o = td.decode_attention_rope(
        q, k, v, cos, sin, positions, _view(layout, k_buffer, L), _view(layout, v_buffer, L),
        scaling, width, num_splits=splits,
    )  # fmt: skip

    k_view, v_view = _view(layout, k_two, L), _view(layout, v_two, L)
    q_rot = td.rope_store(q, k, v, cos, sin, positions, k_view, v_view)
    lengths = (positions + 1).clamp(max=width)
    expected = td.decode_attention(
        q_rot, k_view, v_view, lengths, scaling, width, num_splits=splits
    )

    assert o.shape == (bs, H, d) and o.dtype == dtype
    assert torch.equal(_bits(qkv), _bits(qkv_before)), "q, k or v changed"
    assert torch.isfinite(o).all(), f"a NaN was read: rows {(~torch.isfinite(o)).nonzero()}"
    assert torch.isfinite(expected).all(), "the two-launch version read a NaN"
    # The caches, bit for bit (NaNs included): the same entries written, nothing else.
    assert torch.equal(_bits(k_buffer), _bits(k_two)), "keys differ from rope_store's"
    assert torch.equal(_bits(v_buffer), _bits(v_two)), "values differ from rope_store's"
    changed = (_bits(k_buffer) != _bits(k_before)).flatten().sum()
    assert int(changed) > 0, "no key written"
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 * ONE_ULP[dtype], torch.float16: 2 * ONE_ULP[dtype]}  # fmt: skip
    atol = 1e-5 if dtype == torch.float32 else 1e-6
    torch.testing.assert_close(
        o.float(), expected.float(), atol=atol, rtol=tol[dtype],
        msg=lambda m: f"vs rope_store + decode_attention: {m}",
    )  # fmt: skip
    # Position 0 attends its new key alone: the output is the new value (up to rounding).
    for row in (positions == 0).nonzero().flatten().tolist():
        value = v[row].repeat_interleave(g, dim=0)
        torch.testing.assert_close(o[row].float(), value.float(), atol=0, rtol=ONE_ULP[dtype])


GROUPS = [("attention_rope", CASES, check_case)]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[str, str | None]:
    return run_child(__file__, tmp_path_factory.mktemp("decode_attention_rope"))


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_rope_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"attention_rope/{name}")


if __name__ == "__main__":
    run_cases(GROUPS, sys.argv[1])
