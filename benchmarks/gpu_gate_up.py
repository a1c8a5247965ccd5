"""The decode step's gate/up projection and SiLU x up as one Triton GEMM
(``decoder.gate_up_kernel``, :func:`kernels.matmul.gate_up_config`) against cuBLAS then the
SiLU kernel, on one H200 (issue 6).

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_gate_up --out $OUT

In one call, correctness before speed:
1. ``ops``: at every row count the decode graphs use (1 to 32 by powers of two, then
   multiples of 32 up to 256), the op alone in CUDA graphs (weights from HBM): cuBLAS +
   SiLU, the Triton GEMM with ``gate_up_config``, with ``default_config``, and the best of
   ``benchmarks.gpu_matmul``'s search; each config checked against torch first.
2. ``check_fp32`` / ``check_bf16``: the engine checks of ``benchmarks.gpu_engine`` with the
   kernel on (float32 greedy = Hugging Face; bf16 graphs = eager, log-probs against a
   Hugging Face forward).
3. ``rounds``: the engine with the kernel off and on, interleaved, at batches 256 and 64.
4. ``side_by_side``: off, on and eager ``generate`` in turn at batch 256.
Writes ``$OUT/gpu_gate_up.json`` after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import torch

from benchmarks import gpu_engine as ge
from benchmarks import gpu_matmul as gm
from services.rollout.fast_engine import FastEngine
from services.rollout.kernels.matmul import default_config, gate_up_config

ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256)
"""The decode graphs' row buckets (``cuda_graphs.row_bucket``) up to 256."""
SETTINGS = {"off": dict(gate_up=False), "on": dict(gate_up=True)}
RESULTS: dict = {}


def _save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gate_up.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def _run(name: str, fn, out: Path):
    start = time.monotonic()
    try:
        RESULTS[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded; the next steps still run
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    if isinstance(RESULTS[name], dict):
        RESULTS[name]["step_s"] = time.monotonic() - start
    print(name, json.dumps(RESULTS[name], default=str)[:3000], flush=True)
    _save(out)
    return RESULTS[name]


def ops(jobs: int) -> dict:
    """Per row count: graph microseconds of cuBLAS + SiLU, of ``gate_up_config``, of
    ``default_config`` and of the search's best; a config that mismatches torch is recorded
    as an error instead of a time."""
    shape = gm.SHAPES["gate_up"]
    device = torch.device("cuda")
    pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) if jobs > 1 else None
    out = {}
    try:
        gm.precompile(pool, [job for job in gm.stage1_jobs(ROWS, device) if job[0] == "gate_up"])
        for m in ROWS:
            found = gm.tune_shape("gate_up", m, pool)
            operands = gm._operands(shape, m, device)
            ref = gm._torch_call(shape, operands)(0)
            row = {
                "cublas_silu_us": found["torch_graph_us"],
                "search_best_us": (found.get("best_graph") or {}).get("graph_us"),
                "search_best_config": (found.get("best_graph") or {}).get("config"),
                "search_failed": found["failed"],
            }
            for name, config in (
                ("rule", gate_up_config(m)),
                ("default", default_config(m, shape["n"], shape["k"], device)),
            ):
                call = gm._triton_call(shape, operands, config)
                why = gm.mismatch(call(0), ref)
                row[f"{name}_config"] = asdict(config)
                row[f"{name}_us"] = (
                    f"mismatch: {why}" if why else gm.time_graph(gm._graph_of(call), 20)
                )
            out[str(m)] = row
            print(m, row, flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    return out


def rounds(engine: FastEngine, batch: int, count: int) -> dict:
    """tokens/s (median of 3 calls after a warm-up) with the kernel off and on, in turn
    ``count`` times; each round's on/off ratio."""
    runs = {name: [] for name in SETTINGS}
    try:
        for _ in range(count):
            for name, settings in SETTINGS.items():
                ge.configure(engine, settings)
                runs[name].append(ge.engine_speed(engine, batch, 256, 256, False)["tok_s"])
    finally:
        ge.configure(engine, SETTINGS["off"])
    return {
        "tok_s": runs,
        "median_tok_s": {k: statistics.median(v) for k, v in runs.items()},
        "on_over_off_by_round": [a / b for a, b in zip(runs["on"], runs["off"], strict=True)],
    }


def side_by_side(engine: FastEngine, pairs: int) -> dict:
    """Off, on and eager ``generate`` at batch 256 in turn, ``pairs`` times."""
    model = engine.runner.model
    turns = []
    try:
        for _ in range(pairs):
            turn = {}
            for name, settings in SETTINGS.items():
                ge.configure(engine, settings)
                turn[name] = ge.engine_speed(engine, 256, 256, 256, False)["tok_s"]
            turn["eager"] = ge.hf_speed(model, 256, 256, 256, False)["tok_s"]
            turns.append(turn)
    finally:
        ge.configure(engine, SETTINGS["off"])
    ratios = {name: [t[name] / t["eager"] for t in turns] for name in SETTINGS}
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
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--steps", default="ops,check_fp32,check_bf16,rounds,side_by_side")
    args = parser.parse_args()
    out, steps = Path(args.out), set(args.steps.split(","))
    RESULTS["meta"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python3 -m benchmarks.gpu_gate_up "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    }
    if "ops" in steps:
        _run("ops", lambda: ops(args.jobs), out)
    if "check_fp32" in steps:
        _run("check_fp32", lambda: ge.check_fp32(args.workdir, SETTINGS["on"]), out)
    engine = ge.qwen05_engine(args.workdir)
    if "check_bf16" in steps:

        def check_bf16():
            ge.configure(engine, SETTINGS["on"])
            try:
                return {"gate_up_kernel": engine.decoder.gate_up_kernel, **ge.check_bf16(engine)}
            finally:
                ge.configure(engine, SETTINGS["off"])

        _run("check_bf16", check_bf16, out)
    if "rounds" in steps:
        for batch in (256, 64):
            _run(f"rounds_b{batch}", lambda b=batch: rounds(engine, b, args.rounds), out)
    if "side_by_side" in steps:
        _run("side_by_side_b256", lambda: side_by_side(engine, args.pairs), out)
    _save(out)


if __name__ == "__main__":
    main()
