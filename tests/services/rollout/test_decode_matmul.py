"""The few-row Triton GEMMs (``kernels/matmul.py``) against torch, in the Triton interpreter.

As in test_decode_kernels.py: the interpreter is chosen when the kernels are first jitted,
so every kernel check runs in one child process started with TRITON_INTERPRET=1, which
writes each case's outcome to a JSON file; each pytest item below reads its own. The
config chooser and the split plan are checked in this process (no triton needed).

Tolerances: float32 differs from torch only in summation order. In bfloat16 the
interpreter rounds float32 -> bf16 toward zero (a GPU rounds to nearest), so a kernel
output may be one bf16 ulp from a round-to-nearest reference (see ONE_ULP in
test_decode_kernels.py); gate_up_silu rounds its gate and up sums that way too, whose
effect on silu(gate) * up is bounded per element (``_silu_mul_bound``).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from interpreter_cases import needs_triton, report, run_cases, run_child

from services.rollout.fast import kernels as td
from services.rollout.fast.fused_ops import rms_norm, silu_mul_halves
from services.rollout.fast.kernels.matmul import (
    MatmulConfig,
    default_config,
    partial_config,
    split_plan,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_ULP = 2**-7
"""One bf16 ulp relative to the value (8 significant bits): ulp(v) <= 2**-7 |v|."""


def _cfg(block_m, block_n, block_k, split_k=1) -> dict:
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k)


def _linear(dtype, m, n, k, bias, config=None, sliced=False, wide_x=False) -> dict:
    """A linear case: shapes, a bias or not, the config (None: default_config), the weight
    as rows of a larger fused buffer (``sliced``) and x as the first K columns of wider
    rows (``wide_x``)."""
    return dict(dtype=dtype, m=m, n=n, k=k, bias=bias, config=config, sliced=sliced,
                wide_x=wide_x)  # fmt: skip


# N never a multiple of block_n but in one case; K not a multiple of block_k (the masked
# K loop) except in the *-evenk cases; split 3 of K=400 at block_k 64 is 192 + 192 + 16.
LINEAR_CASES = {
    "fp32-m1-bias-default": _linear("float32", 1, 100, 96, True),
    "fp32-m5-nobias": _linear("float32", 5, 130, 200, False, _cfg(16, 64, 64)),
    "fp32-m33-sliced-bias-split3": _linear(
        "float32", 33, 70, 400, True, _cfg(32, 32, 64, 3), sliced=True, wide_x=True
    ),
    "fp32-m33-evenk": _linear("float32", 33, 96, 128, True, _cfg(16, 32, 64), wide_x=True),
    "bf16-m1-nobias": _linear("bfloat16", 1, 100, 96, False, _cfg(16, 32, 64)),
    "bf16-m5-sliced-bias-default": _linear("bfloat16", 5, 80, 136, True, sliced=True),
    "bf16-m33-bias-split3": _linear("bfloat16", 33, 130, 400, True, _cfg(32, 64, 64, 3)),
    "bf16-m33-sliced-split3-of-k200": _linear(
        "bfloat16", 33, 50, 200, False, _cfg(16, 32, 64, 3), sliced=True, wide_x=True
    ),
    "bf16-m5-evenk-split2": _linear("bfloat16", 5, 64, 256, True, _cfg(16, 32, 64, 2)),
}

# gate_up_silu cases: rows, intermediate size I (never a multiple of block_n), K.
GATE_UP_CASES = {
    "fp32-m5-i100": dict(dtype="float32", m=5, inter=100, k=72, config=_cfg(16, 64, 64)),
    "fp32-m33-i70-split3": dict(dtype="float32", m=33, inter=70, k=400, config=_cfg(32, 32, 64, 3)),
    "bf16-m1-i80-default": dict(dtype="bfloat16", m=1, inter=80, k=128, config=None),
    "bf16-m33-i100-sliced": dict(
        dtype="bfloat16", m=33, inter=100, k=136, config=_cfg(32, 64, 64), sliced=True
    ),
    "bf16-m5-i70-split3": dict(dtype="bfloat16", m=5, inter=70, k=400, config=_cfg(16, 32, 64, 3)),
}


def _config(spec: dict | None) -> MatmulConfig | None:
    return None if spec is None else MatmulConfig(num_warps=4, num_stages=2, **spec)


def _close(actual, expected, atol, rtol, what):
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _weight(rows: int, k: int, dtype, sliced: bool, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, buffer): a (rows, k) weight scaled so outputs are about N(0, 1); ``sliced``:
    rows [7, 7 + rows) and the first k columns of a (rows + 20, k + 8) fused buffer whose
    other entries are NaN (a kernel that reads one of them, other than in a masked-out
    column, returns NaNs)."""
    weight = (torch.randn(rows, k, generator=gen) * k**-0.5).to(dtype)
    if not sliced:
        return weight, weight
    buffer = torch.full((rows + 20, k + 8), float("nan"), dtype=dtype)
    buffer[7 : 7 + rows, :k] = weight
    return buffer[7 : 7 + rows, :k], buffer


def _rows(m: int, k: int, dtype, wide: bool, gen) -> torch.Tensor:
    """x (m, k); ``wide``: the first k columns of (m, k + 24) rows, the rest NaN."""
    x = torch.randn(m, k, generator=gen).to(dtype)
    if not wide:
        return x
    buffer = torch.full((m, k + 24), float("nan"), dtype=dtype)
    buffer[:, :k] = x
    return buffer[:, :k]


def check_linear(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    m, n, k = case["m"], case["n"], case["k"]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = _rows(m, k, dtype, case["wide_x"], gen)
    weight, _ = _weight(n, k, dtype, case["sliced"], gen)
    bias = None
    if case["bias"]:
        # A slice of a fused (q/k/v) bias, as decoder.py passes it.
        bias = torch.randn(n + 30, generator=gen).to(dtype)[10 : 10 + n]
    config = _config(case["config"])
    if config is not None and config.split_k > 1:
        assert split_plan(k, config)[0] > 1, "the case must split"

    got = td.linear(x, weight, bias, config=config)

    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any(), "a NaN: something outside x or the weight was read"
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # What decoder.py computes today (its CPU path), on contiguous copies: torch's CPU bf16
    # F.linear of an x with a wider row stride picked up the NaN padding (torch 2.13).
    today = F.linear(x.contiguous(), weight, bias)
    if dtype == torch.float32:
        _close(got, exact, 1e-5, 1e-5, "vs F.linear")
        return
    # The float32 sum plus bias rounded once (toward zero here): within an ulp of the
    # exact result; torch's bf16 path may round once more (bias added in bf16): 2 ulps.
    _close(got, exact, 1e-6, BF16_ULP, "vs float32 F.linear")
    _close(got, today, 1e-6, 2 * BF16_ULP, "vs bf16 F.linear")


def _silu_mul_bound(gate: torch.Tensor, up: torch.Tensor, outputs_ulps: int) -> torch.Tensor:
    """How far silu(g') * u' rounded to bf16 may be from silu(g) * u when g' and u' are
    within an ulp of g and u (float32 tensors): the first-order effect of each input's ulp
    plus ``outputs_ulps`` output roundings, with 10% slack for the second-order terms."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_silu = sig * (1 + gate * (1 - sig))
    inputs = (d_silu * up * gate).abs() + (silu * up).abs()
    return 1.1 * BF16_ULP * (inputs + outputs_ulps * (silu * up).abs()) + 1e-6


def check_gate_up(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    m, inter, k = case["m"], case["inter"], case["k"]
    gen = torch.Generator().manual_seed(m * 1000 + inter + k)
    x = _rows(m, k, dtype, wide=case.get("sliced", False), gen=gen)
    weight, _ = _weight(2 * inter, k, dtype, case.get("sliced", False), gen)
    config = _config(case["config"])
    if config is not None and config.split_k > 1:
        assert split_plan(k, config)[0] > 1, "the case must split"

    got = td.gate_up_silu(x, weight, config=config)

    assert got.shape == (m, inter) and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any(), "a NaN: something outside x or the weight was read"
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)  # exact sums
    today = silu_mul_halves(F.linear(x.contiguous(), weight))  # decoder.py's CPU path
    if dtype == torch.float32:
        _close(got, F.silu(gate) * up, 1e-5, 1e-5, "vs float32 silu(gate) * up")
        _close(got, today, 1e-5, 1e-5, "vs fused_ops.silu_mul_halves(F.linear)")
        return
    for want, ulps, what in (
        # kernels.silu_mul_halves(F.linear(x, W)) rounds g, u and the output once each.
        (F.silu(gate) * up, 1, "vs float32 silu(gate) * up"),
        # fused_ops' eager bf16 path also rounds silu(g) before the product.
        (today.float(), 3, "vs fused_ops.silu_mul_halves(F.linear)"),
    ):
        excess = (got.float() - want).abs() - _silu_mul_bound(gate, up, ulps)
        worst = int(excess.argmax())
        assert excess.max() <= 0, (
            f"{what}: element {divmod(worst, inter)}: got {got.flatten()[worst]}, "
            f"want {want.flatten()[worst]} (gate {gate.flatten()[worst]}, "
            f"up {up.flatten()[worst]}), over the bound by {excess.max()}"
        )


# Rounding, bit for bit: inputs on a grid (x integers in [-4, 4], weights and bias multiples
# of 2**-10 in [-1/16, 1/16]) make every float32 sum exact in any order, with more
# significant bits than bf16 holds, so the kernel's bf16 outputs are a known function of
# the exact sums; checked with and without split-K (the reduction's epilogue).
ROUNDING_CASES = {
    "linear-bias": dict(kind="linear", split_k=1),
    "linear-bias-split2": dict(kind="linear", split_k=2),
    "gate_up": dict(kind="gate_up", split_k=1),
    "gate_up-split2": dict(kind="gate_up", split_k=2),
}


def _as_interpreter_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as the interpreter rounds: toward zero (the low 16 bits dropped)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def check_rounding(case: dict) -> None:
    gen = torch.Generator().manual_seed(5)
    m, n, k = 33, 100, 136  # K = 128 + 8: split 2 is a long and a short split

    def grid(*shape, top, scale):
        return (torch.randint(-top, top + 1, shape, generator=gen) * scale).to(torch.bfloat16)

    x = grid(m, k, top=4, scale=1.0)
    config = MatmulConfig(32, 64, 64, num_warps=4, num_stages=2, split_k=case["split_k"])
    assert split_plan(k, config)[0] == case["split_k"]
    if case["kind"] == "linear":
        weight, bias = grid(n, k, top=64, scale=2**-10), grid(n, top=64, scale=2**-10)
        got = td.linear(x, weight, bias, config=config)
        exact = F.linear(x.float(), weight.float(), bias.float())  # exact: on the grid
        # The sum and the bias rounded once (toward zero here).
        assert torch.equal(got, _as_interpreter_bf16(exact)), "linear: not rounded once"
        return
    weight = grid(2 * n, k, top=64, scale=2**-10)
    got = td.gate_up_silu(x, weight, config=config)
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)  # exact sums
    g, u = _as_interpreter_bf16(gate).float(), _as_interpreter_bf16(up).float()
    want = _as_interpreter_bf16(g / (1.0 + torch.exp(-g)) * u)  # silu.py's math
    unrounded = _as_interpreter_bf16(gate / (1.0 + torch.exp(-gate)) * up)
    assert (want != unrounded).float().mean() > 0.2, "the inputs must tell the two apart"
    # Bit for bit but where numpy's and torch's float32 exp differ in the last bit.
    same = got == want
    assert same.float().mean() > 0.99, f"gate_up: {int((~same).sum())} elements differ"
    _close(got, want, 0, BF16_ULP, "gate_up within an ulp where not equal")


# The split projection the decoder feeds to the add + norm after o_proj and down_proj:
# linear_partials' float32 partials (one per K split) and add_rms_norm_partials over them.
# Width not a power of two (the norm's masked lanes), x with a wider row stride, a bias.
PARTIAL_CASES = {
    "fp32-m5-split3-bias": dict(dtype="float32", m=5, n=72, k=400, split_k=3, bias=True),
    "fp32-m33-split1": dict(dtype="float32", m=33, n=100, k=136, split_k=1, bias=False),
    "bf16-m33-split3-wide": dict(dtype="bfloat16", m=33, n=100, k=400, split_k=3, bias=False),
    "bf16-m1-split2-bias": dict(dtype="bfloat16", m=1, n=48, k=256, split_k=2, bias=True),
}


def check_partials(case: dict) -> None:
    dtype = DTYPES[case["dtype"]]
    m, n, k = case["m"], case["n"], case["k"]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = _rows(m, k, dtype, case["dtype"] == "bfloat16", gen)
    weight, _ = _weight(n, k, dtype, False, gen)
    config = MatmulConfig(16 if m < 32 else 32, 32, 64, 4, 2, case["split_k"])
    splits = split_plan(k, config)[0]
    assert splits == case["split_k"]

    parts = td.linear_partials(x, weight, config)

    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    # bf16 products are exact in float32: only the summation order differs.
    _close(parts.sum(0), F.linear(x.float(), weight.float()), 1e-5, 1e-5, "partials' sum")
    resid = torch.randn(m, n, generator=gen).to(dtype)
    norm = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if case["bias"] else None

    y, h = td.add_rms_norm_partials(resid, parts, norm, 1e-6, bias)

    assert y.dtype == h.dtype == dtype and not h.isnan().any()
    if dtype == torch.float32:
        ry, rh = td.add_rms_norm_partials_reference(resid, parts, norm, 1e-6, bias)
        _close(y, ry, 1e-6, 1e-6, "residual")
        _close(h, rh, 1e-5, 1e-5, "norm")
        return
    # Bit for bit as the interpreter rounds (toward zero): the partials summed in split
    # order, plus the bias, rounded; the residual add rounded.
    delta = parts[0].clone()
    for split in range(1, splits):
        delta += parts[split]
    if bias is not None:
        delta += bias.float()
    want_y = _as_interpreter_bf16(resid.float() + _as_interpreter_bf16(delta).float())
    assert torch.equal(y, want_y), "residual: not the rounded sum of the split-order partials"
    # The norm of that residual: fused_ops' rounds to nearest at its two roundings, the
    # interpreter toward zero. (Against ``rh`` a residual near zero, where x and delta
    # cancel, would differ relatively by much more: its delta was rounded to nearest.)
    _close(h, rms_norm(y, norm, 1e-6), 1e-6, 2 * BF16_ULP, "norm vs fused_ops.rms_norm")


GROUPS = [
    ("linear", LINEAR_CASES, check_linear),
    ("gate_up_silu", GATE_UP_CASES, check_gate_up),
    ("rounding", ROUNDING_CASES, check_rounding),
    ("partials", PARTIAL_CASES, check_partials),
]


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[str, str | None]:
    return run_child(__file__, tmp_path_factory.mktemp("decode_matmul"))


@needs_triton
@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_linear_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"linear/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(GATE_UP_CASES))
def test_gate_up_silu_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"gate_up_silu/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(PARTIAL_CASES))
def test_split_projection_and_add_norm_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"partials/{name}")


@needs_triton
@pytest.mark.parametrize("name", list(ROUNDING_CASES))
def test_rounding_in_interpreter(interpreter_results, name):
    report(interpreter_results, f"rounding/{name}")


# ---- in this process: the config chooser and the split plan ------------------------------

# Qwen2.5-0.5B's decode GEMMs: (output columns, K); gate_up's columns are I.
QWEN_SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (4864, 896), "down": (896, 4864)}
H200 = torch.device("cpu")  # sm_count's stand-in for a CPU device is an H200's 132 SMs


@pytest.mark.parametrize("m", [1, 256])
def test_default_config_for_qwen_decode(m):
    configs = {name: default_config(m, n, k, H200) for name, (n, k) in QWEN_SHAPES.items()}
    for name, config in configs.items():
        n, k = QWEN_SHAPES[name]
        assert config.block_m >= 16 and config.block_n >= 16 and config.block_k >= 16, name
        assert config.block_m <= max(16, m), f"{name}: {config.block_m}-row tiles for {m} rows"
        splits, k_per_split = split_plan(k, config)
        assert k_per_split % config.block_k == 0 and (splits - 1) * k_per_split < k, name
    # Only down_proj's long K is split, and into more programs than it has tiles.
    assert {name for name, c in configs.items() if c.split_k > 1} == {"down"}
    down = configs["down"]
    tiles = -(-m // down.block_m) * -(-896 // down.block_n)
    assert split_plan(4864, down)[0] * tiles >= min(132, tiles * 8), down
    if m == 256:
        # Enough tiles to fill the 132 SMs without splitting: qkv at 32 rows a tile (144),
        # o at 16 (224), gate/up at 64 (304).
        assert [configs[name].block_m for name in ("qkv", "o", "gate_up")] == [32, 16, 64]
        assert split_plan(4864, down)[0] * 4 * 14 >= 132
    else:
        assert all(c.block_m == 16 for c in configs.values())


@pytest.mark.parametrize("m", [1, 16, 32, 64, 96, 128, 192, 256, 512])
@pytest.mark.parametrize("name", ["o", "down"])
def test_partial_config_makes_about_a_wave(name, m):
    n, k = QWEN_SHAPES[name]
    config = partial_config(m, n, k, 132)
    assert config.block_m <= max(16, m), f"{config.block_m}-row tiles for {m} rows"
    splits, _ = split_plan(k, config)
    programs = -(-m // config.block_m) * -(-n // config.block_n) * splits
    # Never over one wave; under 0.85 of one only where K has no blocks left to split.
    assert programs <= 132, (config, programs)
    assert programs > 0.85 * 132 / 2 or splits == -(-k // config.block_k), (config, programs)


def test_partial_config_picks_what_won_on_the_h200():
    """benchmarks/rollout/split_k.py's search on the H200
    (benchmarks/results/rollout_split_k_search_2026-12-04.json): its best configs, but for o at
    64 rows (best: 4 splits of 32-column tiles, 2.61 us; 7 splits of 64 columns at K steps of 64 took 2.76)."""
    assert partial_config(256, 896, 896, 132) == MatmulConfig(64, 64, 128, 4, 3, 2)
    assert partial_config(256, 896, 4864, 132) == MatmulConfig(64, 128, 128, 4, 4, 4)
    assert partial_config(64, 896, 4864, 132) == MatmulConfig(64, 64, 128, 4, 4, 8)
    assert partial_config(64, 896, 896, 132) == MatmulConfig(64, 64, 128, 4, 3, 7)


def test_split_plan_has_no_empty_split():
    def plan(k, block_k, split_k):
        return split_plan(k, MatmulConfig(16, 64, block_k, 4, 3, split_k))

    assert plan(400, 64, 3) == (3, 192)
    assert plan(200, 64, 3) == (2, 128)  # 3 x 67 rounds up to 3 x 128: only 2 needed
    assert plan(4864, 64, 3) == (3, 1664)
    assert plan(896, 64, 1) == (1, 896)
    assert plan(100, 128, 8) == (1, 128)
    for k in (1, 63, 64, 65, 896, 4864):
        for split_k in (1, 2, 3, 8):
            splits, k_per_split = plan(k, 64, split_k)
            assert 1 <= splits <= split_k and k_per_split % 64 == 0
            assert (splits - 1) * k_per_split < k <= splits * k_per_split


def test_config_rejects_blocks_tl_dot_cannot_take():
    with pytest.raises(AssertionError):
        MatmulConfig(8, 64, 64, 4, 3)
    with pytest.raises(AssertionError):
        MatmulConfig(16, 48, 64, 4, 3)
    with pytest.raises(AssertionError):
        MatmulConfig(16, 64, 64, 4, 3, split_k=0)


def test_no_rows_launch_nothing():
    # No kernel runs (and none is jitted): fine without triton or a GPU.
    assert td.linear(torch.empty(0, 8), torch.randn(4, 8)).shape == (0, 4)
    assert td.gate_up_silu(torch.empty(0, 8), torch.randn(6, 8)).shape == (0, 3)


if __name__ == "__main__":
    run_cases(GROUPS, sys.argv[1])
