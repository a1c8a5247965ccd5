"""The Triton decode kernels against their torch references, in the Triton interpreter (CPU).

The kernel checks run in one child process under the interpreter (``interpreter_cases.py``
says why and how): every case of ``GROUPS``, each pytest item below reading its own
outcome. The references themselves, the split heuristics and ``available`` are checked in
this process (no triton needed).

Tolerances: float32 is close to exact. In bfloat16 the interpreter rounds float32 -> bf16
toward zero (a GPU rounds to nearest), so kernel outputs may differ from a round-to-nearest
reference by one bf16 ulp; the comparisons with the model-dtype references (what decoder.py
computes today, rounding scores and rope products to the model dtype) are looser still.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from interpreter_cases import needs_triton, report, run_cases, run_child

from services.rollout.fast import kernels as td
from services.rollout.fast.fused_ops import rope

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attention(dtype, kvh, g, d, L, width, lengths, layout, splits=None, out=False) -> dict:
    """An attention case: kv heads, groups (query heads per kv head), head_dim, slot_len L of
    the view, width, lengths (one per row; 1 and == width included), the cache layout
    ("layer": one layer of a 5-D buffer, as decoder.py passes it; "sliced": the first L
    positions of longer slots; "permuted": a (slots, L, kvh, d) buffer seen as (slots, kvh,
    L, d)), the number of key splits (None: the heuristic's pick) and whether to pass out."""
    return dict(dtype=dtype, kvh=kvh, g=g, d=d, L=L, width=width, lengths=lengths,
                layout=layout, splits=splits, out=out)  # fmt: skip


ATTENTION_CASES = {
    "fp32-g1-d64-layer": _attention("float32", 2, 1, 64, 200, 150, [1, 150, 64, 65, 99], "layer"),
    "fp32-g7-d128-sliced": _attention("float32", 1, 7, 128, 130, 130, [130, 1, 77], "sliced"),
    "bf16-g2-d128-layer": _attention("bfloat16", 2, 2, 128, 200, 200, [200, 1, 129, 128], "layer"),
    "bf16-g7-d64-permuted": _attention(
        "bfloat16", 2, 7, 64, 100, 70, [70, 1, 3, 64, 65, 33], "permuted"
    ),
    "bf16-g1-d32-width-under-block": _attention("bfloat16", 4, 1, 32, 40, 5, [5, 1, 2], "sliced"),
    "fp16-g2-d64-layer": _attention("float16", 2, 2, 64, 100, 90, [90, 1, 45], "layer"),
    "fp32-g2-d64-split3": _attention(
        "float32", 2, 2, 64, 200, 190, [190, 1, 64, 65, 129], "sliced", splits=3
    ),
    "bf16-g7-d128-split4": _attention(
        "bfloat16", 1, 7, 128, 200, 200, [200, 1, 100], "layer", splits=4
    ),
    "bf16-g1-d64-split2-out": _attention(
        "bfloat16", 2, 1, 64, 160, 128, [128, 1, 64, 65, 127, 2], "permuted", splits=2, out=True
    ),
}

# rope_store cases: rows, query heads, kv heads, head_dim, slot_len of the view, positions
# (0 and L - 1 included; in "outside", L and one past the L + 20 rows of the rope table:
# neither may be written anywhere).
ROPE_CASES = {
    "fp32-h4-kv2-d64": dict(dtype="float32", H=4, kvh=2, d=64, L=50, positions=[0, 49, 7, 20]),
    "bf16-h14-kv2-d128": dict(
        dtype="bfloat16", H=14, kvh=2, d=128, L=200, positions=[199, 0, 100, 63, 64]
    ),
    "fp16-h2-kv1-d32": dict(dtype="float16", H=2, kvh=1, d=32, L=20, positions=[3, 19]),
    "bf16-h8-kv8-d64-outside": dict(
        dtype="bfloat16", H=8, kvh=8, d=64, L=30, positions=[29, 30, 0, 75]
    ),
}

# silu_mul_halves cases: rows, intermediate size (1024 = one block exactly; 1500 = a masked
# tail), dtype.
SILU_CASES = {
    "fp32-r3-i1500": dict(dtype="float32", rows=3, inter=1500),
    "bf16-r5-i1024": dict(dtype="bfloat16", rows=5, inter=1024),
}

# float32 -> model dtype: the interpreter truncates bf16, a GPU rounds to nearest: 1 ulp.
ONE_ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str):
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _cache_pair(layout: str, slots: int, kvh: int, L: int, d: int, dtype, gen):
    """(k_view, v_view, k_buffer, v_buffer): one layer's (slots, kvh, L, d) cache views."""

    def one():
        if layout == "layer":  # layer 1 of (layers, slots, kvh, L, d)
            buffer = torch.randn(3, slots, kvh, L, d, generator=gen).to(dtype)
            return buffer[1], buffer
        if layout == "sliced":  # the first L positions of longer slots
            buffer = torch.randn(slots, kvh, L + 9, d, generator=gen).to(dtype)
            return buffer[:, :, :L], buffer
        assert layout == "permuted"
        buffer = torch.randn(slots, L, kvh, d, generator=gen).to(dtype)
        return buffer.permute(0, 2, 1, 3), buffer

    k_view, k_buffer = one()
    v_view, v_buffer = one()
    return k_view, v_view, k_buffer, v_buffer


def check_attention(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor(case["lengths"], dtype=torch.int64)
    bs, kvh, g, d, L, width = (
        len(lengths),
        case["kvh"],
        case["g"],
        case["d"],
        case["L"],
        case["width"],
    )
    scaling = d**-0.5
    q = torch.randn(bs, kvh * g, d, generator=gen).to(dtype)
    k_cache, v_cache, _, _ = _cache_pair(case["layout"], bs + 2, kvh, L, d, dtype, gen)
    k_clean, v_clean = k_cache.clone(), v_cache.clone()
    # Everything a row must not read is NaN in the views the kernel gets: keys at or past
    # its length, and the two slots past the batch. One NaN read poisons the whole row.
    slot_lengths = torch.cat((lengths, torch.zeros(2, dtype=torch.int64)))
    readable = torch.arange(L)[None, :] < slot_lengths[:, None]  # (slots, L)
    for view in (k_cache, v_cache):
        view.masked_fill_(~readable[:, None, :, None], float("nan"))
    out = torch.full((bs, kvh * g, d), float("nan"), dtype=dtype) if case["out"] else None

    o = td.decode_attention(
        q, k_cache, v_cache, lengths, scaling, width, out=out, num_splits=case["splits"]
    )
    assert o.shape == q.shape and o.dtype == dtype
    if out is not None:
        assert o is out
    exact = td.decode_attention_reference(
        q.float(), k_clean.float(), v_clean.float(), lengths, scaling, width
    )
    today = td.decode_attention_reference(q, k_clean, v_clean, lengths, scaling, width)
    # Against float32 math on the same inputs: weights rounded to bf16 for the second dot
    # (relative 2^-8 per term) plus the output's rounding.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[dtype]
    _close(o, exact, tol, tol, "vs float32 reference")
    # Against decoder.py's path (scores rounded to the model dtype as well).
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    _close(o, today, tol, tol, "vs decoder.py's attention")
    # Length 1 attends one key: the output is that value (up to the output's rounding).
    for row in (lengths == 1).nonzero().flatten().tolist():
        expected = v_clean[row, :, 0].repeat_interleave(g, dim=0)
        _close(o[row], expected, 0, ONE_ULP[dtype], f"row {row} of length 1")


def _rope_tables(max_len: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_len, d) as a Llama rotary module makes them (base 10000)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_rope_store(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor(case["positions"], dtype=torch.int64)
    bs, H, kvh, d, L = len(positions), case["H"], case["kvh"], case["d"], case["L"]
    cos, sin = _rope_tables(L + 20, d, dtype)
    inside = [row for row in range(bs) if 0 <= positions[row] < L]  # written to the cache
    in_table = [row for row in range(bs) if 0 <= positions[row] < len(cos)]  # rotated
    # q, k, v as views of one fused projection output (bs, (H + 2 kvh) * d).
    qkv = torch.randn(bs, (H + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, : H * d].view(bs, H, d)
    k = qkv[:, H * d : (H + kvh) * d].view(bs, kvh, d)
    v = qkv[:, (H + kvh) * d :].view(bs, kvh, d)
    # The cache: the first L positions of longer slots (so a write past L would land in
    # memory the test can see), two slots more than rows.
    k_buffer = torch.randn(bs + 2, kvh, L + 7, d, generator=gen).to(dtype)
    v_buffer = torch.randn(bs + 2, kvh, L + 7, d, generator=gen).to(dtype)
    k_before, v_before = k_buffer.clone(), v_buffer.clone()

    q_rot = td.rope_store(q, k, v, cos, sin, positions, k_buffer[:, :, :L], v_buffer[:, :, :L])

    assert q_rot.shape == (bs, H, d) and q_rot.dtype == dtype and q_rot.is_contiguous()
    # Float32 rope rounded once: what the kernel computes (1 ulp: see ONE_ULP).
    rotated = torch.tensor(in_table, dtype=torch.int64)
    cos_at, sin_at = cos[positions[rotated]][:, None], sin[positions[rotated]][:, None]
    q_exact, _ = rope(q[rotated].float(), k[rotated].float(), cos_at.float(), sin_at.float())
    _close(q_rot[rotated], q_exact.to(dtype), 1e-7, ONE_ULP[dtype], "q vs float32 rope")
    # A position past the table reads no table (zeros) rather than memory past it.
    for row in set(range(bs)) - set(in_table):
        assert not q_rot[row].any(), f"row {row} past the table"
    # Against decoder.py's path (rope in the model dtype, both caches by index_put), on
    # the rows whose position is inside the slot (index_put would fail on the others).
    rows = torch.tensor(inside, dtype=torch.int64)
    k_today = torch.zeros(len(inside), kvh, L, d, dtype=dtype)
    v_today = torch.zeros(len(inside), kvh, L, d, dtype=dtype)
    q_today = td.rope_store_reference(
        q[rows], k[rows], v[rows], cos, sin, positions[rows], k_today, v_today
    )
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    _close(q_rot[rows], q_today, tol, tol, "q vs decoder.py's rope")
    at = positions[rows]
    slot = torch.arange(len(inside))
    _close(k_buffer[rows, :, at], k_today[slot, :, at], tol, tol, "keys vs decoder.py's")
    assert torch.equal(v_buffer[rows, :, at], v_today[slot, :, at])

    written = torch.zeros(k_buffer.shape[:3], dtype=torch.bool)  # (slots, kvh, L + 7)
    for row in inside:
        position = int(positions[row])
        written[row, :, position] = True
        cos_at, sin_at = cos[position].float(), sin[position].float()
        _, k_exact = rope(q[row].float(), k[row].float(), cos_at, sin_at)
        key = k_buffer[row, :, position]
        _close(key, k_exact.to(dtype), 1e-7, ONE_ULP[dtype], f"key of row {row}")
        assert torch.equal(v_buffer[row, :, position], v[row]), f"value of row {row}"
    # Not one other element of either buffer changed (bitwise).
    assert torch.equal(k_buffer[~written], k_before[~written]), "a key was written elsewhere"
    assert torch.equal(v_buffer[~written], v_before[~written]), "a value was written elsewhere"


# Prefill through rope_store: a row per prompt token, prompts back to back, each stored in
# its slot(s) of a slot table (-1: none), rotated keys also returned. Over 1024 rows, so
# the kernel takes many rows a program; lengths not a multiple of its 16.
ROPE_PREFILL_CASES = {
    "fp32-3-prompts-1100-rows": dict(lengths=[500, 351, 249], slots=[[0, 3], [1, -1], [2, -1]]),
}


def check_rope_store_prefill(case: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    H, kvh, d, L = 2, 1, 16, 512
    lengths = case["lengths"]
    rows = sum(lengths)
    cos, sin = _rope_tables(L, d, torch.float32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    table = torch.tensor(case["slots"]).repeat_interleave(torch.tensor(lengths), dim=0)
    qkv = torch.randn(rows, (H + 2 * kvh) * d, generator=gen)
    q = qkv[:, : H * d].view(rows, H, d)
    k = qkv[:, H * d : (H + kvh) * d].view(rows, kvh, d)
    v = qkv[:, (H + kvh) * d :].view(rows, kvh, d)
    slots = int(table.max()) + 2
    k_cache = torch.randn(slots, kvh, L, d, generator=gen)
    v_cache = torch.randn(slots, kvh, L, d, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k_out = torch.full((rows, kvh, d), float("nan"))

    q_rot = td.rope_store(q, k, v, cos, sin, positions, k_cache, v_cache, slots=table, k_out=k_out)

    cos_at, sin_at = cos[positions][:, None], sin[positions][:, None]
    q_exact, k_exact = rope(q, k, cos_at, sin_at)
    _close(q_rot, q_exact, 1e-6, 1e-6, "q")
    _close(k_out, k_exact, 1e-6, 1e-6, "rotated keys")
    written = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    start = 0
    for n, prompt_slots in zip(lengths, case["slots"], strict=True):
        for slot in (s for s in prompt_slots if s >= 0):
            written[slot, :, :n] = True
            want = k_out[start : start + n].transpose(0, 1)  # (kvh, n, d)
            assert torch.equal(k_cache[slot, :, :n], want), f"keys in slot {slot}"
            assert torch.equal(v_cache[slot, :, :n], v[start : start + n].transpose(0, 1))
        start += n
    assert torch.equal(k_cache[~written], k_before[~written]), "a key was written elsewhere"
    assert torch.equal(v_cache[~written], v_before[~written]), "a value was written elsewhere"


def check_silu_mul_halves(case: dict) -> None:
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(case["rows"])
    wide = torch.randn(case["rows"], 2 * case["inter"] + 8, generator=gen).to(dtype)
    gate_up = wide[:, : 2 * case["inter"]]  # a row stride wider than the row
    got = td.silu_mul_halves(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _close(got, want, atol=ONE_ULP[dtype] * 4, rtol=ONE_ULP[dtype] * 2, what="silu(gate) * up")


# sample_gumbel cases (see check_sampling): the draw's distribution, its log-probs in each
# dtype (masked tails, -inf logits, a wide row stride), seeds, gpu_sampler on top, and the
# vocabulary split over several programs drawing what one program per row draws.
SAMPLE_CASES = {
    "distribution-v12-block16": dict(kind="distribution"),
    "logprobs-fp32-v300-block64": dict(kind="logprobs", dtype="float32", vocab=300, block=64),
    "logprobs-bf16-v300-block64": dict(kind="logprobs", dtype="bfloat16", vocab=300, block=64),
    "logprobs-fp16-v5000-default-block": dict(
        kind="logprobs", dtype="float16", vocab=5000, block=None
    ),
    "seeds": dict(kind="seeds"),
    "gpu_sampler": dict(kind="sampler"),
    # (rows, vocab, block, split counts to compare with splits=1): 300 columns are not whole
    # blocks of 64; 3 splits of 128 leave 44 for the last, 4 asked give 3 (no empty split);
    # 100 columns in blocks of 16 split 4 (32, 32, 32, 4) and 7 (auto) ways.
    "splits-same-token": dict(
        kind="splits",
        combos=[(4, 300, 64, "float32", (3, 4, None)), (4, 100, 16, "bfloat16", (4, None))],
    ),
}
SAMPLE_T = 0.7
# sample_inverse_cdf cases (see check_sampling_cdf): the draw's distribution over several
# splits, log-probs with masked columns and splits with nothing finite, seeds, and the
# split layout not moving the draws.
CDF_CASES = {
    "distribution-v32-two-splits": dict(kind="distribution"),
    "logprobs-bf16-v300": dict(kind="logprobs", dtype="bfloat16", vocab=300),
    "logprobs-fp32-v300": dict(kind="logprobs", dtype="float32", vocab=300),
    "seeds": dict(kind="seeds"),
    "split-layouts": dict(kind="splits"),
    "gpu_sampler": dict(kind="sampler"),
}


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * len(tokens)
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    return float(((observed - expected) ** 2 / expected).sum())


def check_sampling(case: dict) -> None:
    kind = case["kind"]
    gen = torch.Generator().manual_seed(11)
    if kind == "distribution":
        # 800 draws from one row of 12 logits, seen through a row stride of 0; one block of
        # 16 columns, 4 of them masked. Deterministic (fixed seed); a correct sampler gives
        # chi-square ~ 11 +- 5 with 11 degrees of freedom, 40 has p ~ 3e-5.
        base = torch.tensor([0.3, -1.2, 1.2, 0.0, -0.5, 0.9, -0.9, 0.6, -0.2, 0.2, 1.0, -0.7])
        rows = 800
        tokens, logprobs = td.sample_gumbel(base.expand(rows, -1), SAMPLE_T, 1234, 8, block=16)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert tokens.shape == logprobs.shape == (rows,)
        assert 0 <= int(tokens.min()) and int(tokens.max()) < len(base)
        log_probs = torch.log_softmax(base / SAMPLE_T, dim=-1)
        chi2 = _chi_square(tokens, log_probs.exp().double())
        assert chi2 < 40, f"chi-square {chi2:.1f} vs softmax(x / T)"
        # ... and it can tell: at T = 0.5 instead of 0.7 the same draws give ~140.
        assert _chi_square(tokens, torch.softmax(base.double() / 0.5, -1)) > 100
        _close(logprobs, log_probs[tokens], 1e-6, 1e-6, "log-probs")
    elif kind == "logprobs":
        dtype, vocab, rows = DTYPES[case["dtype"]], case["vocab"], 6
        wide = (torch.randn(rows, vocab + 7, generator=gen) * 3).to(dtype)
        wide[1, ::3] = float("-inf")  # masked tokens: never drawn
        wide[2, :-8] = float("-inf")  # one finite token in the row: drawn, log-prob 0
        logits = wide[:, :vocab]
        kwargs = {} if case["block"] is None else {"block": case["block"]}
        tokens, logprobs = td.sample_gumbel(logits, SAMPLE_T, 99, 0, **kwargs)
        expected = torch.log_softmax(logits.float() / SAMPLE_T, dim=-1)
        _close(logprobs, expected.gather(1, tokens[:, None])[:, 0], 1e-5, 1e-5, "log-probs")
        assert torch.isfinite(logprobs).all() and int(tokens[1]) % 3 != 0
        assert int(tokens[2]) == vocab - 1 and float(logprobs[2]) == 0.0
    elif kind == "seeds":
        logits = torch.randn(8, 64, generator=gen) * 0.5
        first = td.sample_gumbel(logits, 1.0, 5, 0, block=32)
        again = td.sample_gumbel(logits, 1.0, 5, 0, block=32)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        for seed, offset in ((6, 0), (5, 4), (5 + 2**40, 0), (2**64 - 1, 2**40)):
            other = td.sample_gumbel(logits, 1.0, seed, offset, block=32)[0]
            assert not torch.equal(first[0], other), f"seed {seed}, offset {offset}"
    elif kind == "splits":
        for rows, vocab, block, dtype, counts in case["combos"]:
            logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DTYPES[dtype])
            logits[1, ::3] = float("-inf")  # masked tokens: never drawn
            logits[1, : vocab // 2] = float("-inf")  # whole splits with nothing finite
            logits[2, :-1] = float("-inf")  # only the last column: drawn, log-prob 0
            expected = torch.log_softmax(logits.float() / SAMPLE_T, dim=-1)
            one = td.sample_gumbel(logits, SAMPLE_T, 77, 5, block=block, splits=1)
            for splits in (1, *counts):
                what = f"rows {rows}, vocab {vocab}, block {block}, splits {splits}"
                tokens, logprobs = (
                    one
                    if splits == 1
                    else td.sample_gumbel(logits, SAMPLE_T, 77, 5, block=block, splits=splits)
                )
                assert torch.equal(tokens, one[0]), f"{what}: {tokens} vs {one[0]}"
                at = expected.gather(1, tokens[:, None])[:, 0]
                _close(logprobs, at, 1e-5, 1e-5, f"log-probs, {what}")
                assert int(tokens[1]) % 3 != 0 and int(tokens[1]) >= vocab // 2, what
                assert int(tokens[2]) == vocab - 1 and float(logprobs[2]) == 0.0, what
    else:
        assert kind == "sampler"
        from services.rollout.fast import gpu_sampler
        from services.rollout.fast.gpu_sampler import sample_rows
        from services.rollout.types import SamplingParams

        gpu_sampler.SAMPLING_KERNEL = "gumbel"  # this group checks the Gumbel kernel

        logits = (torch.randn(5, 300, generator=gen) * 2).bfloat16()
        params = SamplingParams(temperature=0.8, seed=3)

        def two_steps():
            step_gen = torch.Generator().manual_seed(3)
            return [sample_rows(logits, params, step_gen) for _ in range(2)]

        (t1, lp1), (t2, lp2) = two_steps()
        (u1, _), (u2, _) = two_steps()
        assert torch.equal(t1, u1) and torch.equal(t2, u2), "same seed, same tokens"
        assert not torch.equal(t1, t2), "each step draws anew"
        expected = torch.log_softmax(logits.float() / 0.8, dim=-1)
        _close(lp1, expected.gather(1, t1[:, None])[:, 0], 1e-5, 1e-5, "sample_rows log-probs")
        greedy, _ = sample_rows(logits, SamplingParams(temperature=0.0), None)
        assert torch.equal(greedy, logits.argmax(-1))
        want = td.sample_gumbel(
            logits, 0.8, *gpu_sampler.step_seed(torch.Generator().manual_seed(3))
        )
        assert torch.equal(t1, want[0]), "sample_rows draws with the chosen kernel"
        gpu_sampler.SAMPLING_KERNEL = "inverse_cdf"


def check_sampling_cdf(case: dict) -> None:
    from services.rollout.fast.kernels.sampling_cdf import sample_inverse_cdf as draw

    kind = case["kind"]
    gen = torch.Generator().manual_seed(12)
    if kind == "distribution":
        # 320 draws from one row of 32 logits in two splits of 16 columns: a correct
        # sampler gives chi-square ~ 31 +- 8 with 31 degrees of freedom; 70 has p ~ 1e-4.
        base = torch.randn(32, generator=gen) * 0.4
        rows = 320
        tokens, logprobs = draw(base.expand(rows, -1), SAMPLE_T, 1234, 8, block=16, split_blocks=1)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
        assert 0 <= int(tokens.min()) and int(tokens.max()) < len(base)
        log_probs = torch.log_softmax(base / SAMPLE_T, dim=-1)
        chi2 = _chi_square(tokens, log_probs.exp().double())
        assert chi2 < 70, f"chi-square {chi2:.1f} vs softmax(x / T)"
        assert _chi_square(tokens, torch.softmax(base.double() / 0.2, -1)) > 150  # it can tell
        _close(logprobs, log_probs[tokens], 1e-6, 1e-6, "log-probs")
    elif kind == "logprobs":
        dtype, vocab, rows = DTYPES[case["dtype"]], case["vocab"], 6
        logits = (torch.randn(rows, vocab + 7, generator=gen) * 3).to(dtype)[:, :vocab]
        logits[1, ::3] = float("-inf")  # masked tokens: never drawn
        logits[2, :-8] = float("-inf")  # whole splits with nothing finite, then 8 columns
        logits[3, :-1] = float("-inf")  # only the last column: drawn, log-prob 0
        logits[4, 0] = 30.0  # one column with nearly all the mass, the first
        tokens, logprobs = draw(logits, SAMPLE_T, 99, 0, block=16, split_blocks=2)
        expected = torch.log_softmax(logits.float() / SAMPLE_T, dim=-1)
        _close(logprobs, expected.gather(1, tokens[:, None])[:, 0], 1e-5, 1e-5, "log-probs")
        assert torch.isfinite(logprobs).all() and int(tokens[1]) % 3 != 0
        assert int(tokens[2]) >= vocab - 8
        assert int(tokens[3]) == vocab - 1 and float(logprobs[3]) == 0.0
        assert int(tokens[4]) == 0
    elif kind == "seeds":
        logits = torch.randn(8, 64, generator=gen) * 0.5
        first = draw(logits, 1.0, 5, 0, block=16)
        again = draw(logits, 1.0, 5, 0, block=16)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        for seed, offset in ((6, 0), (5, 4), (5 + 2**40, 0), (2**64 - 1, 2**40)):
            other = draw(logits, 1.0, seed, offset, block=16)[0]
            assert not torch.equal(first[0], other), f"seed {seed}, offset {offset}"
    elif kind == "sampler":
        from services.rollout.fast import gpu_sampler
        from services.rollout.types import SamplingParams

        logits = (torch.randn(5, 300, generator=gen) * 2).bfloat16()
        params = SamplingParams(temperature=0.8, seed=3)
        assert gpu_sampler.SAMPLING_KERNEL == "inverse_cdf"  # the default
        runs = [
            gpu_sampler.sample_rows(logits, params, torch.Generator().manual_seed(3))
            for _ in range(2)
        ]
        (t1, lp1), (t2, _) = runs
        assert torch.equal(t1, t2), "same seed, same tokens"
        want = draw(logits, 0.8, *gpu_sampler.step_seed(torch.Generator().manual_seed(3)))
        assert torch.equal(t1, want[0]), "sample_rows draws with the chosen kernel"
        expected = torch.log_softmax(logits.float() / 0.8, dim=-1)
        _close(lp1, expected.gather(1, t1[:, None])[:, 0], 1e-5, 1e-5, "sample_rows log-probs")
    else:
        assert kind == "splits"
        # 300 columns as 1, 3 (128, 128, 44) and 19 splits: the same tokens (the draws sit
        # far from the boundaries that float32 rounding could move).
        logits = (torch.randn(4, 300, generator=gen) * 2).bfloat16()
        logits[1, :200] = float("-inf")
        layouts = [dict(block=512, split_blocks=1), dict(block=64, split_blocks=2), dict(block=16)]
        drawn = [draw(logits, SAMPLE_T, 77, 5, **kw) for kw in layouts]
        for (tokens, logprobs), kw in zip(drawn[1:], layouts[1:], strict=True):
            assert torch.equal(tokens, drawn[0][0]), f"{kw}: {tokens} vs {drawn[0][0]}"
            _close(logprobs, drawn[0][1], 1e-6, 1e-6, f"log-probs, {kw}")
        assert int(drawn[0][0][1]) >= 200


GROUPS = [
    ("attention", ATTENTION_CASES, check_attention),
    ("rope_store", ROPE_CASES, check_rope_store),
    ("rope_store_prefill", ROPE_PREFILL_CASES, check_rope_store_prefill),
    ("silu_mul_halves", SILU_CASES, check_silu_mul_halves),
    ("sampling", SAMPLE_CASES, check_sampling),
    ("sampling_cdf", CDF_CASES, check_sampling_cdf),
]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[str, str | None]:
    return run_child(__file__, tmp_path_factory.mktemp("decode_kernels"))


@needs_triton
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_decode_attention_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"attention/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_store_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"rope_store/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(ROPE_PREFILL_CASES))
def test_rope_store_prefill_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"rope_store_prefill/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(SILU_CASES))
def test_silu_mul_halves_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"silu_mul_halves/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(SAMPLE_CASES))
def test_sample_gumbel_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"sampling/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(CDF_CASES))
def test_sample_inverse_cdf_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"sampling_cdf/{name}")


# ---- in this process: the references, the split heuristic, availability ----------------


def test_attention_reference_equals_per_row_softmax():
    gen = torch.Generator().manual_seed(2)
    bs, kvh, g, d, L, width = 3, 2, 3, 16, 12, 10
    lengths = torch.tensor([10, 1, 6])
    q = torch.randn(bs, kvh * g, d, generator=gen, dtype=torch.float64)
    k_cache = torch.randn(bs + 1, kvh, L, d, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(bs + 1, kvh, L, d, generator=gen, dtype=torch.float64)
    o = td.decode_attention_reference(q, k_cache, v_cache, lengths, 0.3, width)
    for row in range(bs):
        n = int(lengths[row])
        for head in range(kvh * g):
            keys, values = k_cache[row, head // g, :n], v_cache[row, head // g, :n]
            weights = torch.softmax(keys @ q[row, head] * 0.3, dim=0)
            torch.testing.assert_close(o[row, head], weights @ values)


def test_rope_store_reference_rotates_and_scatters():
    gen = torch.Generator().manual_seed(3)
    bs, H, kvh, d, L = 2, 4, 2, 8, 6
    positions = torch.tensor([5, 0])
    cos, sin = _rope_tables(L, d, torch.float64)
    q = torch.randn(bs, H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(bs, kvh, d, generator=gen, dtype=torch.float64)
    v = torch.randn(bs, kvh, d, generator=gen, dtype=torch.float64)
    k_cache = torch.zeros(bs, kvh, L, d, dtype=torch.float64)
    v_cache = torch.zeros(bs, kvh, L, d, dtype=torch.float64)
    q_rot = td.rope_store_reference(q, k, v, cos, sin, positions, k_cache, v_cache)
    half = d // 2
    for row in range(bs):
        p = int(positions[row])
        for x, rotated in ((q[row], q_rot[row]), (k[row], k_cache[row, :, p])):
            low, high = x[..., :half], x[..., half:]
            expected = torch.cat(
                (
                    low * cos[p, :half] - high * sin[p, :half],
                    high * cos[p, half:] + low * sin[p, half:],
                ),
                dim=-1,
            )
            torch.testing.assert_close(rotated, expected)
        torch.testing.assert_close(v_cache[row, :, p], v[row])
    assert int((k_cache != 0).any(-1).sum()) == bs * kvh  # one position per (row, kv head)


def test_split_count_only_splits_few_long_rows():
    assert td.split_count(programs=512, width=4096, sms=132) == 1  # the GPU is full
    assert td.split_count(programs=8, width=100, sms=132) == 1  # too few keys to share
    assert td.split_count(programs=8, width=4096, sms=132) == td.MAX_SPLITS
    splits = td.split_count(programs=64, width=8192, sms=132)
    assert 1 < splits <= td.MAX_SPLITS and splits * 64 >= 2 * 132
    assert td.split_count(programs=8, width=3 * td.KEYS_PER_SPLIT_MIN, sms=132) == 3


def test_sample_splits_fill_the_gpu_with_whole_blocks():
    from services.rollout.fast.kernels.runtime import cdiv
    from services.rollout.fast.kernels.sampling import SAMPLE_BLOCK, sample_splits

    def check(rows, vocab, block, sms=132, asked=None):
        splits, chunk = sample_splits(rows, vocab, block, sms, asked)
        assert 1 <= splits <= cdiv(vocab, block), (rows, vocab, block, splits)
        assert chunk % block == 0 and chunk > 0, chunk
        assert (splits - 1) * chunk < vocab <= splits * chunk, "an empty split or a lost column"
        return splits, chunk

    # A decode batch of 256 rows over Qwen's vocabulary: more than one program per row, and
    # about 8 per SM in all.
    splits, chunk = check(256, 151936, SAMPLE_BLOCK)
    assert splits > 1 and 6 * 132 <= 256 * splits <= 12 * 132, splits
    # One row: a program per block (more would have less than a block each).
    assert check(1, 151936, SAMPLE_BLOCK) == (cdiv(151936, SAMPLE_BLOCK), SAMPLE_BLOCK)
    assert check(1, 151936, 16)[0] == 8 * 132  # capped by the programs wanted, not the blocks
    # Rows enough to fill the GPU alone: one program per row.
    assert check(4096, 151936, SAMPLE_BLOCK) == (1, cdiv(151936, SAMPLE_BLOCK) * SAMPLE_BLOCK)
    assert check(3, 12, 16) == (1, 16)  # less than a block
    # Asked: at least a block each, none empty (4 asked: 75 columns each round up to 128,
    # which 3 splits cover).
    assert check(4, 300, 64, asked=3) == (3, 128)
    assert check(4, 300, 64, asked=4) == (3, 128)
    assert check(4, 300, 64, asked=100) == (5, 64)
    assert check(4, 300, 64, asked=1) == (1, 320)
    for rows in (1, 2, 7, 64, 255, 1000):
        for vocab in (1, 15, 16, 17, 2047, 2048, 2049, 32000, 151936):
            for block in (16, 64, SAMPLE_BLOCK):
                check(rows, vocab, block)
                check(rows, vocab, block, asked=5)


def test_available(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    has_triton = importlib.util.find_spec("triton") is not None
    assert not td.available("cpu")
    assert td.available("cuda") == has_triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert td.available(torch.device("cpu")) == has_triton


if __name__ == "__main__":
    run_cases(GROUPS, sys.argv[1])
