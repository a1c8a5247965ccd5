"""The engine breakdown benchmark's CPU-checkable parts: kernel names sorted into kinds, and
a generate call's timeline at the engine's named ranges (a tiny model; host times only)."""

import pytest

from benchmarks.rollout.engine_breakdown import generate_timeline, kind_of
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.rollout.fast.engine import FastEngine

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_tst_64x64_64x13_2x4_h_bz_splitK_TNT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("_decode_attention_kernel", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_add (compiled)"),
        ("_silu_mul_halves_kernel", "silu"),
        ("_cdf_partial_kernel", "sampling"),
        ("Memcpy HtoD (Pageable -> Device)", "other"),
    ],
)
def test_kernels_are_sorted_into_kinds(name, kind):
    assert kind_of(name) == kind


def test_a_generate_timeline_has_each_phase_in_order(tmp_path):
    engine = FastEngine(str(make_tiny_qwen2_dir(tmp_path)), max_num_seqs=4)
    result = generate_timeline(engine, batch=4, prompt_len=6, new=10)
    inside = result["host_ms_inside"]
    for phase in ("meshrl/setup", "meshrl/plan", "meshrl/first_tokens", "meshrl/admit"):
        assert inside[phase] >= 0
    assert inside["meshrl/decode"] > 0 and inside["generate"] >= inside["meshrl/decode"]
    points = [row["point"] for row in result["rows"]]
    assert points[0] == "generate >" and points[-1] == "generate <"
    assert points.index("meshrl/admit >") < points.index("meshrl/decode >")
    assert points.index("meshrl/finish >") > points.index("meshrl/collect >")
    assert not any(p.startswith(("meshrl/sample", "meshrl/record")) for p in points)
    hosts = [row["host_ms"] for row in result["rows"]]
    assert hosts == sorted(hosts)
