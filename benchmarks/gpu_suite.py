"""GPU suite: ceilings, then each fast path checked against its plain path and timed.

    python3 -m benchmarks.gpu_suite --sections ceilings,engine,hf,ipc,trainer --out $OUT
    python3 -m benchmarks.gpu_suite --sections ceilings,side_by_side --out $OUT

Run on the lent H200 (see docs/benchmarks.md, "Method"). Every section runs in a try block,
so one failure still leaves the others' figures; results go to ``$OUT/gpu_suite.json``
after each section and a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

import torch

RESULTS: dict = {}


def _save(out: Path) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate on random data."""
    from benchmarks.weight_sync.cuda_ipc import copy_ms

    n = 2 * 2**30
    copy_gbs = 2 * n / (copy_ms(n) / 1e3) / 1e9
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        m @ k
    start.record()
    for _ in range(10):
        m @ k
    end.record()
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    return {
        "copy_gbs": copy_gbs,
        "bf16_matmul_tflops": tflops,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def engine_section(workdir: str, out: Path, quick: bool = False, tuned: dict | None = None):
    """Checks and times the fast engine; returns it (the HF section reuses its model)."""
    from benchmarks.rollout import engine as ge

    _run("engine_check_fp32", lambda: ge.check_fp32(workdir), out)
    _run("packed_attention_check", ge.check_packed_attention, out)
    start = time.monotonic()
    engine = ge.qwen05_engine(workdir)
    RESULTS["engine_init"] = {
        "seconds": time.monotonic() - start,
        "ops_compiled": engine.decoder.ops.compiled,
    }
    _run("engine_check_bf16", lambda: ge.check_bf16(engine), out)
    if not quick:
        _run("sampling_kernel", ge.sampling_kernel_us, out)
        _run("engine_variants_b256", lambda: ge.decode_variants(engine, 256, tuned), out)
        # The timed runs below take the settings with the best mean of their two runs.
        try:
            name, settings = ge.best_settings(RESULTS["engine_variants_b256"])
            ge.configure(engine, settings, tuned)
            RESULTS["engine_settings"] = {"variant": name, **settings}
        except Exception as e:  # noqa: BLE001
            RESULTS["engine_settings"] = {"error": f"{type(e).__name__}: {e}"}
    for batch in (64, 256):
        _run(f"engine_b{batch}", lambda b=batch: ge.engine_speed(engine, b, 256, 256, False), out)
    if not quick:
        _run("engine_eager_b256", lambda: ge.engine_speed(engine, 256, 256, 256, True), out)
    _record_floors(
        engine, {b: RESULTS.get(f"engine_b{b}", {}).get("tok_s") or 0.0 for b in (64, 256)}
    )
    if not quick:
        _run("engine_profile", lambda: ge.profile_decode(engine, out), out)
    RESULTS["engine_graphs"] = {
        "count": engine.graphs.num_graphs,
        "capture_s": engine.graphs.capture_seconds,
    }
    _save(out)
    engine.release_memory()
    return engine


def _record_floors(engine, tok_s_by_batch: dict[int, float]) -> None:
    """The bandwidth floor at each batch (256 + 256 tokens, from the ceilings' copy
    bandwidth, when measured) and the share of it that ``tok_s_by_batch`` reached."""
    from benchmarks.rollout import engine as ge

    copy = RESULTS.get("ceilings", {}).get("copy_gbs")
    if not copy:
        return
    for batch, got in tok_s_by_batch.items():
        floor = ge.bandwidth_floor_tok_s(engine, batch, 256, 256, copy)
        RESULTS[f"floor_b{batch}"] = {"tok_s": floor, "fraction": got / floor}


def cuda_tests() -> dict:
    """The engine's CUDA test files (kernels against their torch references, graphs = eager
    = plain engine), run in a child process; their exit code and summary line."""
    import subprocess
    import sys

    files = ("test_decode_kernels_cuda.py", "test_fast_engine_cuda.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + [f"tests/services/rollout/{f}" for f in files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {"rc": run.returncode, "summary": run.stdout.strip().splitlines()[-1:]}


def ab_section(workdir: str, out: Path) -> None:
    """The engine's A/B runs (``rollout/engine.py``'s ``ab_runs``), then the engine and
    eager ``generate`` side by side at batches 64 and 256, with the CUDA test files' result
    first."""
    from benchmarks.rollout import engine as ge

    _run("cuda_tests", cuda_tests, out)
    engine = ge.qwen05_engine(workdir)
    _run("ab_b256", lambda: ge.ab_runs(engine, 256), out)
    for batch in (64, 256):
        _run(f"engine_b{batch}", lambda b=batch: ge.engine_speed(engine, b, 256, 256, False), out)
    hf_section(engine, out, 0.0, eager_only=True)


def side_by_side_section(workdir: str, out: Path) -> None:
    """The engine checked first (its CUDA tests; float32: graphs = eager = a Hugging Face
    forward; bf16: graphs = eager, log-probs against a Hugging Face forward). Then it and
    eager ``generate`` timed in turn three times at batches 64 and 256
    (``gpu_engine.side_by_side``), the share of the bandwidth floor, eager ``generate``
    with Hugging Face's own ("eager") attention, and prefill chunk sizes."""
    from benchmarks.rollout import engine as ge
    from benchmarks.rollout.engine_breakdown import variants

    _run("cuda_tests", cuda_tests, out)
    _run("engine_check_fp32", lambda: ge.check_fp32(workdir), out)
    engine = ge.qwen05_engine(workdir)
    _run("engine_check_bf16", lambda: ge.check_bf16(engine), out)
    for batch in (64, 256):
        _run(f"side_by_side_b{batch}", lambda b=batch: ge.side_by_side(engine, b), out)
    best = {
        b: max((p["engine"] for p in RESULTS[f"side_by_side_b{b}"].get("pairs", [])), default=0.0)
        for b in (64, 256)
    }
    _record_floors(engine, best)
    model = engine.runner.model
    for batch in (256, 64):
        _run(
            f"hf_attn_eager_b{batch}",
            lambda b=batch: ge.hf_speed(model, b, 256, 256, False, attention="eager"),
            out,
        )
    _run("prefill_chunks_b256", lambda: variants(engine, chunks_only=True), out)


def hf_section(engine, out: Path, deadline: float, eager_only: bool = False) -> None:
    from benchmarks.rollout import engine as ge

    model = engine.runner.model
    for batch in (64, 256):
        _run(f"hf_eager_b{batch}", lambda b=batch: ge.hf_speed(model, b, 256, 256, False), out)
    if eager_only:
        return
    _run("hf_static_b256", lambda: ge.hf_speed(model, 256, 256, 256, True), out)
    if time.monotonic() < deadline - 90:
        _run("hf_static_b64", lambda: ge.hf_speed(model, 64, 256, 256, True), out)


def _matmul_summary(tune: dict) -> dict:
    """What the decoder needs of the GEMM search (its full output is rollout_matmul.json)."""
    keep = ("torch_us", "torch_graph_us", "best", "best_graph", "default")
    shapes = {
        name: {m: {k: found[k] for k in keep if k in found} for m, found in by_m.items()}
        for name, by_m in tune.get("shapes", {}).items()
    }
    return {
        "shapes": shapes,
        "layer_graph": tune.get("layer_graph"),
        "total_s": tune.get("total_s"),
    }


def _run(name: str, fn, out: Path) -> None:
    start = time.monotonic()
    try:
        RESULTS[name] = fn()
    except Exception as e:  # noqa: BLE001 - a failed section must not stop the others
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    RESULTS[name]["wall_s"] = time.monotonic() - start
    print(f"[{name}] {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
    _save(out)


def _table() -> str:
    rows = []
    for name, r in RESULTS.items():
        if not isinstance(r, dict):
            continue
        keys = [
            k
            for k in (
                "tok_s",
                "fraction",
                "copy_gbs",
                "bf16_matmul_tflops",
                "mfu",
                "sync_ms",
                "copy_ms",
                "seconds",
                "error",
            )
            if k in r
        ]
        rows.append(f"{name:28s} " + "  ".join(f"{k}={_fmt(r[k])}" for k in keys))
    return "\n".join(rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)[:200]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="ceilings,engine,hf,ipc,trainer")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="skip the engine variants/eager/profile and trainer checkpointing",
    )
    parser.add_argument(
        "--hf-eager-only",
        action="store_true",
        help="time only eager generate (static-cache generate compiles for 25 to 50 s)",
    )
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    RESULTS["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "sections": sorted(sections),
    }
    if "ceilings" in sections:
        _run("ceilings", ceilings, out)
    tuned = None
    if "matmul" in sections:
        from benchmarks.rollout import engine as ge
        from benchmarks.rollout.matmul import tune

        _run("matmul_tune", lambda: _matmul_summary(tune(m_values=(256, 64), out=out)), out)
        try:
            tuned = ge.tuned_configs(RESULTS["matmul_tune"])
            RESULTS["matmul_configs"] = {str(k): str(v) for k, v in tuned.items()}
        except Exception as e:  # noqa: BLE001
            RESULTS["matmul_configs"] = {"error": f"{type(e).__name__}: {e}"}
    engine = None
    if sections & {"engine", "hf"}:
        try:
            engine = engine_section(args.workdir, out, args.quick, tuned)
        except Exception as e:  # noqa: BLE001
            RESULTS["engine_setup"] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
    if "engine_ab" in sections:
        ab_section(args.workdir, out)
    if "side_by_side" in sections:
        side_by_side_section(args.workdir, out)
    if "ipc" in sections:
        from benchmarks.weight_sync.cuda_ipc import ipc_bench

        _run("ipc", lambda: ipc_bench(args.workdir), out)
    if "trainer" in sections:
        from benchmarks.trainer.update import trainer_bench

        _run(
            "trainer",
            lambda: trainer_bench(deadline - 200, args.workdir, str(out), args.quick),
            out,
        )
    if "hf" in sections and engine is not None:
        hf_section(engine, out, deadline, args.hf_eager_only)
    _save(out)
    print("\n" + _table(), flush=True)


if __name__ == "__main__":
    main()
