"""The decode kernels on a real GPU (bf16 tensor-core dots, which the interpreter test
cannot reach) against the torch reference; skipped without CUDA and triton."""

import importlib.util

import pytest
import torch

from services.rollout.fast import kernels as td
from services.rollout.fast.fused_ops import add_rms_norm

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


def test_sample_gumbel_splits_draw_what_one_program_draws():
    from services.rollout.fast.kernels.sampling import SAMPLE_BLOCK, sample_splits

    g = torch.Generator(device="cuda").manual_seed(3)
    rows, vocab, t = 256, 151936, 0.8
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).bfloat16()
    logits[1, ::3] = float("-inf")
    logits[2, :-1] = float("-inf")  # only the last column is finite
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sample_splits(rows, vocab, SAMPLE_BLOCK, sms)[0] > 1  # auto does split here
    for seed, offset in ((1234, 0), (2**61 + 9, 2**40 + 4)):
        one_tokens, one_logprobs = td.sample_gumbel(logits, t, seed, offset, splits=1)
        tokens, logprobs = td.sample_gumbel(logits, t, seed, offset)
        assert torch.equal(tokens, one_tokens)
        torch.testing.assert_close(logprobs, one_logprobs, atol=1e-5, rtol=1e-5)
    assert int(tokens[2]) == vocab - 1 and float(logprobs[2]) == 0.0


def test_sample_gumbel_logprobs_and_frequencies():
    from services.rollout.fast.gpu_sampler import sample_rows
    from services.rollout.types import SamplingParams

    g = torch.Generator(device="cuda").manual_seed(2)
    rows, vocab, t = 256, 151936, 0.8
    wide = torch.randn(rows, vocab + 64, device="cuda", generator=g) * 3
    logits = wide.bfloat16()[:, :vocab]  # a row stride wider than the row
    tokens, logprobs = td.sample_gumbel(logits, t, 1234, 0)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < vocab
    want = torch.log_softmax(logits.float() / t, dim=-1)
    torch.testing.assert_close(
        logprobs, want.gather(1, tokens[:, None])[:, 0], atol=1e-4, rtol=1e-4
    )
    assert (tokens != logits.argmax(-1)).sum() > rows // 2  # sampled, not greedy
    again = td.sample_gumbel(logits, t, 1234, 0)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], logprobs)
    assert not torch.equal(td.sample_gumbel(logits, t, 1234, 4)[0], tokens)

    # Frequencies: 200k draws of one row of 12 logits (row stride 0); chi-square with 11
    # degrees of freedom (~11 +- 5 for a correct sampler).
    base = torch.linspace(-1.5, 1.5, 12, device="cuda")[torch.randperm(12, device="cuda")]
    draws = 200_000
    tokens, _ = td.sample_gumbel(base.expand(draws, -1).bfloat16(), t, 7, 0)
    probs = torch.softmax(base.bfloat16().float().double() / t, -1)
    observed = torch.bincount(tokens, minlength=12).double()
    chi2 = float(((observed - probs * draws) ** 2 / (probs * draws)).sum())
    assert chi2 < 45, chi2

    # Through gpu_sampler with the engine's CUDA generator: a re-seeded generator repeats.
    params = SamplingParams(temperature=t, seed=5)

    def steps():
        gen = torch.Generator(device="cuda").manual_seed(5)
        return [sample_rows(logits, params, gen)[0] for _ in range(3)]

    first, second = steps(), steps()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])


def test_sample_inverse_cdf_logprobs_and_frequencies():
    g = torch.Generator(device="cuda").manual_seed(4)
    rows, vocab, t = 256, 151936, 0.8
    wide = torch.randn(rows, vocab + 64, device="cuda", generator=g) * 3
    logits = wide.bfloat16()[:, :vocab]  # a row stride wider than the row
    logits[1, ::3] = float("-inf")  # masked columns: never drawn
    logits[2, :-1] = float("-inf")  # only the last column is finite
    tokens, logprobs = td.sample_inverse_cdf(logits, t, 1234, 0)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    want = torch.log_softmax(logits.float() / t, dim=-1)
    torch.testing.assert_close(
        logprobs, want.gather(1, tokens[:, None])[:, 0], atol=1e-4, rtol=1e-4
    )
    assert int(tokens[1]) % 3 != 0 and int(tokens[2]) == vocab - 1
    again = td.sample_inverse_cdf(logits, t, 1234, 0)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], logprobs)
    assert not torch.equal(td.sample_inverse_cdf(logits, t, 1234, 4)[0], tokens)

    # Frequencies, 200k draws each: one row of 12 logits (one split), chi-square with 11
    # degrees of freedom; a 4,000-column row in 4 splits of 1,024, its columns grouped in
    # 16 bins of about equal mass, chi-square with 15.
    base = torch.linspace(-1.5, 1.5, 12, device="cuda")[torch.randperm(12, device="cuda")]
    draws = 200_000
    tokens, _ = td.sample_inverse_cdf(base.expand(draws, -1).bfloat16(), t, 7, 0, block=16)
    probs = torch.softmax(base.bfloat16().float().double() / t, -1)
    observed = torch.bincount(tokens, minlength=12).double()
    chi2 = float(((observed - probs * draws) ** 2 / (probs * draws)).sum())
    assert chi2 < 45, chi2
    row = torch.randn(4000, device="cuda", generator=g).bfloat16()
    tokens, _ = td.sample_inverse_cdf(row.expand(draws, -1), 1.0, 8, 0, split_blocks=1)
    probs = torch.softmax(row.float().double(), -1)
    edges = torch.searchsorted(
        probs.cumsum(0), torch.linspace(0, 1, 17, device="cuda")[1:-1].double()
    )
    bins = torch.bucketize(tokens, edges, right=True)
    expected = (
        torch.diff(torch.cat([probs.new_zeros(1), probs.cumsum(0)[edges - 1], probs.new_ones(1)]))
        * draws
    )
    observed = torch.bincount(bins, minlength=16).double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 55, chi2  # 15 degrees of freedom: ~15 +- 5.5


@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("n,k", [(896, 896), (896, 4864)])
def test_split_projection_and_its_add_norm_match_torch(rows, n, k):
    """The decoder's split o/down projection: partials (kernels.partial_config's tiling) sum
    to F.linear's product, and the add + norm over them is the torch path's up to a bf16 ulp
    of the projection (different GEMM kernels round differently)."""
    g = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    resid = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    config = td.partial_config(rows, n, k, td.sm_count(torch.device("cuda")))
    parts = td.linear_partials(x, w, config)
    assert parts.shape[0] == td.matmul.split_plan(k, config)[0] > 1
    want = x.float() @ w.float().T
    torch.testing.assert_close(parts.sum(0), want, atol=1e-3, rtol=1e-3)
    y, h = td.add_rms_norm_partials(resid, parts, norm_w, 1e-6)
    ry, rh = td.add_rms_norm_partials_reference(resid, parts, norm_w, 1e-6)
    assert torch.equal(y, ry)
    # The norm's mean of squares is summed in another order: an output may round the other
    # way, one bf16 ulp.
    torch.testing.assert_close(h.float(), rh.float(), atol=1e-6, rtol=2**-7)
    ty, th = add_rms_norm(resid, torch.nn.functional.linear(x, w), norm_w, 1e-6)
    torch.testing.assert_close(y.float(), ty.float(), atol=0.05, rtol=2**-7)
    torch.testing.assert_close(h.float(), th.float(), atol=0.05, rtol=2**-6)
