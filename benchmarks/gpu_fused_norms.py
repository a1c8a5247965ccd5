"""The decode step with its norms and residual adds inside the GEMMs against the engine's
default, on one H200 (issue 6: fewer kernels per layer).

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_fused_norms --out $OUT

The default decode step runs nine kernels a layer: the compiled add + RMSNorm twice, the
q/k/v, o, gate/up and down GEMMs (cuBLAS, down with its split-K reduce), SiLU x up and the
attention. ``decoder.norms_in_gemms`` runs six: the norm in the prologue of the q/k/v and
gate/up GEMMs, SiLU x up in gate/up's epilogue, the residual add in the epilogue of o and
of down's reduce (``services/rollout/kernels/matmul.py``, Triton).

In one call, correctness before speed:
1. ``tune``: the plain and fused GEMM shapes at 256 and 64 rows (``benchmarks.gpu_matmul``);
   each candidate config is checked against its torch path before it is timed.
2. ``check_fp32``: float32, 4 layers of the 0.5B shape, the fused step in graphs against a
   Hugging Face forward, greedy tokens and log-probs.
3. ``check_bf16``: the full model in bf16, fused against the default: greedy prefixes, and
   each one's sampled log-probs against a Hugging Face forward over its own tokens.
4. ``rounds``: the variants at batch 256, interleaved, ``--rounds`` times (256 prompt + 256
   new tokens, T = 1, as every engine figure in docs/benchmarks.md).
5. ``side_by_side``: the default, the fused step and eager ``generate`` timed in turn,
   three times, at batch 256.
Writes ``$OUT/gpu_fused_norms.json`` after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_engine as ge
from benchmarks.gpu_matmul import ALL_SHAPES, tune
from benchmarks.gpu_models import make_model_dir
from services.rollout.engine import SamplingParams
from services.rollout.fast_engine import FastEngine
from services.rollout.native_engine import NativeEngine

VARIANTS = {
    "default": {},
    "triton_gemm_tuned": dict(gemm="tuned"),
    "fused_norms_tuned": dict(gemm="tuned", norms=True),
    "fused_norms_default_configs": dict(gemm="default", norms=True),
}
RESULTS: dict = {}


def _save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_fused_norms.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def _run(name: str, fn, out: Path):
    start = time.monotonic()
    try:
        RESULTS[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded; the next steps still run
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    if isinstance(RESULTS[name], dict):
        RESULTS[name]["step_s"] = time.monotonic() - start
    print(name, json.dumps(RESULTS[name], default=str)[:1500], flush=True)
    _save(out)
    return RESULTS[name]


def diagnose_norm_kernels() -> dict:
    """The fused-norm GEMMs against the plain Triton GEMM on rows normed by the eager
    ``fused_ops.rms_norm`` (the same tiles and sums: they should agree to an ulp), and
    against torch, at 256 rows of the 0.5B shape, with the sums of squares handed in parts
    and with the kernel's own first pass; each with its default config and the config
    call 1 found best for the plain op."""
    from services.rollout import kernels
    from services.rollout.fused_ops import rms_norm
    from services.rollout.kernels.matmul import MatmulConfig, RowNorm, gate_up_silu, linear

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, 896, generator=g, device="cuda").bfloat16()
    gain = (1 + 0.1 * torch.randn(896, generator=g, device="cuda")).bfloat16()
    normed = rms_norm(x, gain, 1e-6)
    squares = x.float().pow(2).view(256, 28, 32).sum(-1)
    out = {}
    for name, rows, fn, plain, torch_path, best in (
        ("gate_up+norm", 9728, gate_up_silu, gate_up_silu,
         lambda w: kernels.silu_mul_halves(torch.nn.functional.linear(normed, w)),
         MatmulConfig(64, 64, 64, 4, 3)),
        ("qkv+norm", 1152, linear, linear,
         lambda w: torch.nn.functional.linear(normed, w), MatmulConfig(64, 64, 128, 4, 3)),
    ):  # fmt: skip
        w = (torch.randn(rows, 896, generator=g, device="cuda") * 896**-0.5).bfloat16()
        want_torch = torch_path(w).float()
        for config_name, config in (("default", None), ("best_plain", best)):
            base = plain(normed, w, config=config).float()
            for squares_name, handed in (("handed", squares), ("own_pass", None)):
                got = fn(x, w, norm=RowNorm(gain, 1e-6, handed), config=config).float()
                ulp = 2.0**-7 * base.abs().clamp(min=2.0**-10)
                out[f"{name}/{config_name}/{squares_name}"] = {
                    "vs_plain_triton_max_abs": float((got - base).abs().max()),
                    "vs_plain_triton_over_2_ulps": int(((got - base).abs() > 2 * ulp).sum()),
                    "vs_torch_max_abs": float((got - want_torch).abs().max()),
                    "plain_triton_vs_torch_max_abs": float((base - want_torch).abs().max()),
                    "elements": got.numel(),
                }
    return out


def check_fp32(workdir: str) -> dict:
    """float32, 4 layers: the fused step (default Triton configs) in CUDA graphs and
    eagerly against a Hugging Face forward, greedy, 16 slots for 40 sequences."""
    path = make_model_dir(f"{workdir}/qwen05_l4_fp32", layers=4, dtype=torch.float32)
    fast = FastEngine(
        path, dtype="float32", device="cuda", max_num_seqs=16, gpu_memory_utilization=0.2,
        max_model_len=512,
    )  # fmt: skip
    ge.configure(fast, dict(gemm="default", norms=True))
    assert fast.decoder.fuses_norms
    prompts = ge.random_prompts(11, 20, 4, 200, 151936)
    params = SamplingParams(temperature=0, max_tokens=48, n=2)
    graphs = fast.generate(prompts, params)
    fast.graphs.enabled = False
    eager = fast.generate(prompts, params)
    fast.graphs.enabled = True
    plain = NativeEngine.generate(fast, prompts, params)  # the Hugging Face forward
    rows_same, prefix = ge._prefix_agreement(graphs.responses, plain.responses)
    out = {
        "fuses_norms": fast.decoder.fuses_norms,
        "graphs_equal_eager_fast": graphs.responses.tolist() == eager.responses.tolist(),
        "graphs_vs_hf_rows_identical": rows_same,
        "graphs_vs_hf_mean_prefix": prefix,
        "graphs_vs_hf_logprob_max_abs": ge._lp_diff(graphs, plain, rows_same == 1.0),
    }
    del fast
    torch.cuda.empty_cache()
    return out


def check_bf16(engine: FastEngine, tuned: dict) -> dict:
    """bf16, full model: the fused step against the default, greedy (rounding may flip a
    near-tie, after which rows part), and for each its sampled log-probs against a Hugging
    Face forward over the same tokens (what the trainer computes)."""
    prompts = ge.random_prompts(21, 24, 8, 256, 151936)
    repeated = prompts.select([i for i in range(len(prompts)) for _ in range(2)])
    greedy = SamplingParams(temperature=0, max_tokens=64, n=2)
    sampled = SamplingParams(temperature=1.0, max_tokens=128, n=2, seed=5)
    out, greedy_tokens = {}, {}
    for name in ("default", "fused_norms_tuned"):
        ge.configure(engine, VARIANTS[name], tuned)
        greedy_tokens[name] = engine.generate(prompts, greedy).responses
        result = engine.generate(prompts, sampled)
        scored = engine.score(repeated, result.responses, 1.0, with_entropy=False)
        diff = (scored.logprobs.values - result.logprobs.values).abs()
        out[name] = {
            "fuses_norms": engine.decoder.fuses_norms,
            "engine_vs_hf_forward_logprob_mean_abs": float(diff.mean()),
            "engine_vs_hf_forward_logprob_max_abs": float(diff.max()),
        }
    ge.configure(engine, {})
    same, prefix = ge._prefix_agreement(
        greedy_tokens["default"], greedy_tokens["fused_norms_tuned"]
    )
    out["fused_vs_default_greedy_rows_identical"] = same
    out["fused_vs_default_greedy_mean_prefix"] = prefix
    return out


def rounds(engine: FastEngine, tuned: dict, count: int, batch: int) -> dict:
    """Each variant's tokens/s (median of 3 generate calls after a warm-up), the variants
    interleaved ``count`` times; per variant the median, and each round's ratio to the
    default of the same round."""
    runs = {name: [] for name in VARIANTS}
    try:
        for _ in range(count):
            for name, settings in VARIANTS.items():
                ge.configure(engine, settings, tuned)
                runs[name].append(ge.engine_speed(engine, batch, 256, 256, False)["tok_s"])
    finally:
        ge.configure(engine, {})
    out = {"tok_s": runs, "median_tok_s": {k: statistics.median(v) for k, v in runs.items()}}
    out["ratio_to_default_by_round"] = {
        name: [a / b for a, b in zip(values, runs["default"], strict=True)]
        for name, values in runs.items()
        if name != "default"
    }
    return out


def side_by_side(engine: FastEngine, tuned: dict, pairs: int, fused: str) -> dict:
    """The default engine, the ``fused`` variant and eager ``generate`` at batch 256 timed
    in turn ``pairs`` times; each engine's ratio to the eager call of its own turn."""
    model = engine.runner.model
    turns = []
    try:
        for _ in range(pairs):
            ge.configure(engine, {})
            default = ge.engine_speed(engine, 256, 256, 256, False)["tok_s"]
            ge.configure(engine, VARIANTS[fused], tuned)
            fast = ge.engine_speed(engine, 256, 256, 256, False)["tok_s"]
            eager = ge.hf_speed(model, 256, 256, 256, False)["tok_s"]
            turns.append({"default": default, fused: fast, "eager": eager})
    finally:
        ge.configure(engine, {})
    ratios = {name: [t[name] / t["eager"] for t in turns] for name in ("default", fused)}
    return {
        "turns": turns,
        "ratios": ratios,
        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "min_ratio": {k: min(v) for k, v in ratios.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--workdir", default="/tmp/meshrl_bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--steps", default="diagnose,tune,check_fp32,check_bf16,rounds,side_by_side"
    )
    args = parser.parse_args()
    out, steps = Path(args.out), set(args.steps.split(","))
    RESULTS["meta"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python3 -m benchmarks.gpu_fused_norms "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    }
    tuned: dict = {}
    if "diagnose" in steps:
        _run("diagnose_norm_kernels", diagnose_norm_kernels, out)
    if "tune" in steps:
        found = _run("tune", lambda: tune((256, 64), out, names=tuple(ALL_SHAPES)), out)
        if "shapes" in found:
            tuned = ge.tuned_configs(found)
            RESULTS["tuned_configs"] = {str(k): str(v) for k, v in tuned.items()}
            # The whole search is in gpu_matmul.json; here only its summary.
            RESULTS["tune"] = {
                name: {
                    m: {
                        key: f.get(key)
                        for key in ("torch_us", "torch_graph_us", "best_graph", "failed")
                    }
                    for m, f in by_m.items()
                }
                for name, by_m in found["shapes"].items()
            }
            _save(out)
    if "check_fp32" in steps:
        _run("check_fp32", lambda: check_fp32(args.workdir), out)
    start = time.monotonic()
    engine = ge.qwen05_engine(args.workdir)
    RESULTS["engine_init_s"] = time.monotonic() - start
    if "check_bf16" in steps:
        _run("check_bf16", lambda: check_bf16(engine, tuned), out)
    if "rounds" in steps:
        _run("rounds_b256", lambda: rounds(engine, tuned, args.rounds, 256), out)
    if "side_by_side" in steps:
        medians = RESULTS.get("rounds_b256", {}).get("median_tok_s", {})
        fused = max(
            ("fused_norms_tuned", "fused_norms_default_configs"),
            key=lambda k: medians.get(k, 0.0),
        )
        _run("side_by_side_b256", lambda: side_by_side(engine, tuned, args.pairs, fused), out)
    _save(out)


if __name__ == "__main__":
    main()
