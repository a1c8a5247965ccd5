"""The persistent layer tail on a real GPU (bf16 tensor-core dots, all programs at once,
release/acquire counters between SMs), against the unfused torch path; skipped without
CUDA and triton."""

import importlib.util
from dataclasses import replace

import pytest
import torch

import services.rollout.kernels.persistent_tail as lt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs a CUDA device and triton",
    ),
]

HIDDEN, INTER = 896, 4864  # Qwen2.5-0.5B's layer: 14 x 64 attention columns


def _case(rows: int, dtype, seed: int, biases: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(dtype)

    w = lt.TailWeights(
        o_weight=r(HIDDEN, HIDDEN),
        o_bias=r(HIDDEN) if biases else None,
        post_norm_weight=1 + r(HIDDEN, std=0.1),
        gate_up_weight=r(2 * INTER, HIDDEN),
        down_weight=r(HIDDEN, INTER),
        down_bias=r(HIDDEN) if biases else None,
        next_norm_weight=1 + r(HIDDEN, std=0.1),
    )
    return r(rows, HIDDEN, std=1.0), r(rows, HIDDEN, std=1.0), w


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rows", [256, 100, 7])
@pytest.mark.parametrize("dynamic", [False, True])
def test_bf16_is_as_close_to_float32_as_the_torch_path(rows, dynamic):
    attn, x, w = _case(rows, torch.bfloat16, rows, biases=rows == 100)
    ws = lt.TailWorkspace("cuda")
    config = replace(lt.default_config(rows, HIDDEN), dynamic=dynamic)
    for _ in range(3):  # the counters are left at zero for the next launch
        got_x, got_h = lt.layer_tail(attn, x, w, 1e-6, ws, config=config)
    ws.check()
    assert int(ws.counters.abs().sum()) == 0
    want_x, want_h = lt.layer_tail_reference(attn, x, w, 1e-6)
    f32 = lt.TailWeights(*[None if t is None else t.float() for t in vars(w).values()])
    exact_x, exact_h = lt.layer_tail_reference(attn.float(), x.float(), f32, 1e-6)
    # Both bf16 paths round at the same places; neither is more than 1.5x the other's error.
    for got, want, exact in ((got_x, want_x, exact_x), (got_h, want_h, exact_h)):
        assert torch.isfinite(got).all()
        assert _rel(got, exact) <= 1.5 * _rel(want, exact) + 1e-4


def test_float32_matches_the_torch_path():
    attn, x, w = _case(37, torch.float32, 3, biases=True)
    ws = lt.TailWorkspace("cuda")
    got_x, got_h = lt.layer_tail(attn, x, w, 1e-6, ws)
    want_x, want_h = lt.layer_tail_reference(attn, x, w, 1e-6)
    ws.check()
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)


def test_replays_in_a_cuda_graph_give_the_eager_result():
    attn, x, w = _case(256, torch.bfloat16, 5)
    ws = lt.TailWorkspace("cuda")
    eager_x, eager_h = lt.layer_tail(attn, x, w, 1e-6, ws)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lt.layer_tail(attn, x, w, 1e-6, ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_x, out_h = lt.layer_tail(attn, x, w, 1e-6, ws)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_x, eager_x) and torch.equal(out_h, eager_h)
    ws.check()
