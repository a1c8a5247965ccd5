"""The persistent layer tail (``kernels/persistent_tail.py``) against the unfused torch path, in
Triton's CPU interpreter (one child process, as test_decode_kernels.py explains); the plan's
task counts in this process.

Tolerances: float32 differs from torch only in summation order. In bfloat16 the interpreter
rounds toward zero at each of the path's roundings (x + o, the norm, gate, up, SiLU x up,
the down sum, the second add and norm), so the check there is loose (a relative error of a
few percent); it still catches any wrong index or missed dependency, which give errors of
order one. bf16 on a real GPU is held tighter in test_layer_tail_cuda.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter_cases import needs_triton, report, run_cases, run_child

import services.rollout.kernels.persistent_tail as lt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SMALL = dict(
    block_m=16, block_n_o=16, block_n_gate=16, block_n_down=32, block_k=16, down_chunk=32,
    norm_rows=8,
)  # fmt: skip
"""Tiles small enough that the shapes below have several row blocks, O/G/D tiles and k
chunks, with partial ones at every edge (hidden 48, attention 64, inter 80)."""


def _case(dtype, rows, biases, dynamic, programs, hidden=48, heads_dim=64, inter=80):
    return dict(dtype=dtype, rows=rows, biases=biases, dynamic=dynamic, programs=programs,
                hidden=hidden, heads_dim=heads_dim, inter=inter)  # fmt: skip


CASES = {
    "fp32-one-row-dynamic": _case("float32", 1, True, True, 3),
    "fp32-37-rows-fixed-share": _case("float32", 37, False, False, None),
    "fp32-37-rows-dynamic-biases": _case("float32", 37, True, True, 4),
    "fp32-48-rows-even": _case("float32", 48, False, True, 2, hidden=64, inter=96),
    "bf16-37-rows-dynamic": _case("bfloat16", 37, True, True, 5),
    "bf16-5-rows-fixed-share": _case("bfloat16", 5, False, False, None),
}


def _inputs(case: dict):
    dtype = DTYPES[case["dtype"]]
    g = torch.Generator().manual_seed(case["rows"])
    hidden, inter = case["hidden"], case["inter"]

    def r(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    w = lt.TailWeights(
        o_weight=r(hidden, case["heads_dim"]),
        o_bias=r(hidden) if case["biases"] else None,
        post_norm_weight=1 + r(hidden),
        gate_up_weight=r(2 * inter, hidden),
        down_weight=r(hidden, inter),
        down_bias=r(hidden) if case["biases"] else None,
        next_norm_weight=1 + r(hidden),
    )
    return r(case["rows"], case["heads_dim"], std=1.0), r(case["rows"], hidden, std=1.0), w


def check_case(case: dict) -> None:
    attn, x, w = _inputs(case)
    ws = lt.TailWorkspace("cpu")
    config = lt.TailConfig(**SMALL, dynamic=case["dynamic"])
    for _ in range(2):  # a second launch on the same counters: they were left at zero
        got_x, got_h = lt.layer_tail(attn, x, w, 1e-6, ws, config=config, programs=case["programs"])
        ws.check()
        assert int(ws.counters.abs().sum()) == 0, "counters not zeroed by the last program"
    want_x, want_h = lt.layer_tail_reference(attn, x, w, 1e-6)
    if case["dtype"] == "float32":
        torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
        return
    for got, want in ((got_x, want_x), (got_h, want_h)):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 0.05, f"bf16 relative error {rel}"


def check_gives_up(_: dict) -> None:
    """A fixed share across 3 programs in the interpreter (which runs them one after
    another) leaves the first waiting on work of the second: the waits give up after
    ``max_spins``, the launch ends, and check() says so instead of hanging."""
    attn, x, w = _inputs(_case("float32", 37, False, False, None))
    ws = lt.TailWorkspace("cpu")
    lt.layer_tail(attn, x, w, 1e-6, ws, config=lt.TailConfig(**SMALL), programs=3, max_spins=50)
    with pytest.raises(RuntimeError, match="gave up"):
        ws.check()


def test_plan_counts_every_task_once():
    p = lt.plan(256, 896, 4864, lt.default_config(256, 896))
    # O: 4 row blocks x 14 tiles; N and R: 32 tasks of 8 rows; G: 4 x 76; D: 4 x 4 x 14.
    assert p.offsets == (56, 88, 392, 616, 648)
    assert p.counters == 2 + 4 * (3 + 4)
    assert lt.default_config(16, 896).block_m == 16 and lt.default_config(64, 4096).norm_rows == 2


def test_config_refuses_tiles_the_kernel_cannot_use():
    with pytest.raises(AssertionError, match="down_chunk"):
        lt.TailConfig(down_chunk=100)
    with pytest.raises(AssertionError, match="norm_rows"):
        lt.TailConfig(block_m=16, norm_rows=32)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_child(__file__, tmp_path_factory.mktemp("layer_tail"))


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_layer_tail_matches_the_torch_path(results, name):
    report(results, f"tail/{name}")


@needs_triton
@pytest.mark.slow
def test_a_wait_that_never_ends_gives_up_and_is_reported(results):
    report(results, "gives_up/fixed_share_interpreted")


if __name__ == "__main__":
    run_cases(
        [
            ("tail", CASES, check_case),
            ("gives_up", {"fixed_share_interpreted": {}}, check_gives_up),
        ],
        sys.argv[1],
    )
