"""The decode kernels on a real GPU (bf16 tensor-core dots, which the interpreter test
cannot reach) against the torch reference; skipped without CUDA and triton."""

import importlib.util

import pytest
import torch

from services.rollout import triton_decode as td

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs a CUDA device and triton",
    ),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,groups,splits", [(256, 7, None), (3, 7, None), (5, 1, 3)])
def test_attention_matches_reference(dtype, bs, groups, splits):
    g = torch.Generator(device="cuda").manual_seed(bs)
    kvh, d, slot_len, width = 2, 64, 640, 576
    cache = torch.randn(2, bs + 3, kvh, slot_len, d, device="cuda", dtype=dtype, generator=g)
    k_cache, v_cache = cache[0], cache[1]
    q = torch.randn(bs, kvh * groups, d, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(1, width + 1, (bs,), device="cuda", generator=g)
    lengths[0] = width
    got = td.decode_attention(q, k_cache, v_cache, lengths, 0.125, width, num_splits=splits)
    ref = td.decode_attention_reference(
        q.float(), k_cache.float(), v_cache.float(), lengths, 0.125, width
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_rope_store_matches_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    bs, heads, kvh, d, slot_len = 64, 14, 2, 64, 300
    qkv = torch.randn(bs, (heads + 2 * kvh) * d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(bs, heads, d), k.view(bs, kvh, d), v.view(bs, kvh, d)
    angles = torch.rand(slot_len, d, device="cuda", generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    positions = torch.randint(0, slot_len, (bs,), device="cuda", generator=g)
    caches = [
        torch.zeros(bs, kvh, slot_len, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    ]
    got_q = td.rope_store(q, k, v, cos, sin, positions, caches[0], caches[1])
    want_q = td.rope_store_reference(q, k, v, cos, sin, positions, caches[2], caches[3])
    torch.testing.assert_close(got_q, want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[0], caches[2], atol=2e-2, rtol=2e-2)
    assert torch.equal(caches[1], caches[3])  # values are stored as they come


def test_silu_mul_halves_matches_torch():
    g = torch.Generator(device="cuda").manual_seed(1)
    gate_up = torch.randn(256, 2 * 4864, device="cuda", dtype=torch.bfloat16, generator=g)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).bfloat16()
    torch.testing.assert_close(td.silu_mul_halves(gate_up), want, atol=1e-2, rtol=1e-2)
