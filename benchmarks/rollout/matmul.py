"""The few-row Triton GEMMs (``services/rollout/fast/kernels/matmul.py``) against cuBLAS on
Qwen2.5-0.5B's decode projections, with a small config search (H200).

    python3 -m benchmarks.rollout.matmul --out $OUT [--m 64,256] [--jobs 16]

For each shape (fused qkv with bias, o_proj, gate/up with SiLU x up, down_proj) and each
row count M: torch's time (F.linear; for gate/up F.linear then ``kernels.silu_mul_halves``,
the engine's pair today), every candidate MatmulConfig's (checked against torch first: a
config that fails or mismatches is recorded and skipped), the best and
``default_config``'s. Then the same in CUDA graphs (how the engine runs them, where launch
gaps differ from eager timing): each op alone and the four of a layer together, torch vs
the best configs vs the defaults. Writes ``$OUT/rollout_matmul.json`` and prints a table.

Timing: a torch.cuda._sleep first keeps the GPU busy while the host queues the calls, so
eager figures are GPU time, not Python launch overhead; the mean of 100 calls, the median
of 3 such rounds. Weights cycle through COPIES sets (more than the 50 MB L2 holds), so they
come from HBM as in a 24-layer model; x stays hot, as the previous op's output would be.

The candidates are compiled ahead in ``--jobs`` processes (Triton's compile is the slow
part: about 0.5 s a config, ~150 distinct ones), which fill Triton's on-disk cache for the
timing process; no worker runs while it times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

from services.rollout.fast import kernels
from services.rollout.fast.kernels.matmul import (
    MatmulConfig,
    default_config,
    gate_up_silu,
    linear,
    split_plan,
)
from services.rollout.fast.kernels.runtime import cdiv, sm_count

# Qwen2.5-0.5B: hidden 896, 14 query heads + 2 kv heads of 64, intermediate 4864. ``n`` is
# the output width (I for gate/up, whose weight has 2I rows).
SHAPES = {
    "qkv": dict(n=1152, k=896, bias=True, gate_up=False),
    "o": dict(n=896, k=896, bias=False, gate_up=False),
    "gate_up": dict(n=4864, k=896, bias=False, gate_up=True),
    "down": dict(n=896, k=4864, bias=False, gate_up=False),
}
COPIES = 4
"""Weight sets cycled through: 4 x 30 MB of a layer's four weights, over the H200's L2."""
DTYPE = torch.bfloat16
DEVICE = "cuda"
SMEM_BYTES = 200 * 1024
"""Candidates whose pipeline buffers would need more shared memory (227 KB an SM on the
H200, less what the compiler adds) are not tried."""
STAGE1_TILES = 24
"""Tile shapes timed at 4 warps and 3 stages; the best few then get the other warp and
stage counts."""


def _operands(shape: dict, m: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(m)
    n, k = shape["n"], shape["k"]
    rows = 2 * n if shape["gate_up"] else n
    weights = [
        (torch.randn(rows, k, generator=gen, device=device) * k**-0.5).to(DTYPE)
        for _ in range(COPIES)
    ]
    biases = [None] * COPIES
    if shape["bias"]:
        biases = [torch.randn(n, generator=gen, device=device).to(DTYPE) for _ in range(COPIES)]
    x = torch.randn(m, k, generator=gen, device=device).to(DTYPE)
    return dict(x=x, weights=weights, biases=biases)


def _torch_call(shape: dict, ops: dict):
    x, weights, biases = ops["x"], ops["weights"], ops["biases"]
    if shape["gate_up"]:
        return lambda i: kernels.silu_mul_halves(F.linear(x, weights[i % COPIES]))
    return lambda i: F.linear(x, weights[i % COPIES], biases[i % COPIES])


def _triton_call(shape: dict, ops: dict, config: MatmulConfig):
    x, weights, biases = ops["x"], ops["weights"], ops["biases"]
    if shape["gate_up"]:
        return lambda i: gate_up_silu(x, weights[i % COPIES], config=config)
    return lambda i: linear(x, weights[i % COPIES], biases[i % COPIES], config=config)


def _smem(shape: dict, bm: int, bn: int, bk: int, stages: int) -> int:
    weight_rows = bn * (2 if shape["gate_up"] else 1)
    return stages * (bm + weight_rows) * bk * DTYPE.itemsize


def candidates(shape: dict, m: int, device: torch.device) -> list[MatmulConfig]:
    """The configs tried for ``shape`` at ``m`` rows, before the warp/stage refinement:
    tiles of 16/32/64 rows (no more than M needs), 32/64/128 columns, K steps of 64/128,
    splits 1/2/4/8 of a long K (down_proj's; each split 4+ steps), at 4 warps, 3 stages;
    the STAGE1_TILES whose program count is nearest 1.5 waves, plus the default's tile."""
    n, k = shape["n"], shape["k"]
    sms = sm_count(device)
    tiles = []
    for bm in (16, 32, 64):
        if bm > max(16, 1 << max(0, m - 1).bit_length()):
            continue
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4, 8) if k >= 2048 else (1,):
                    if split > 1 and cdiv(k, bk) < 4 * split:
                        continue
                    if _smem(shape, bm, bn, bk, 3) > SMEM_BYTES:
                        continue
                    programs = cdiv(m, bm) * cdiv(n, bn) * split
                    tiles.append((abs(math.log2(programs / (1.5 * sms))), bm, bn, bk, split))
    tiles.sort()
    configs = [MatmulConfig(bm, bn, bk, 4, 3, split) for _, bm, bn, bk, split in tiles]
    configs = configs[:STAGE1_TILES]
    default = default_config(m, n, k, device)
    if default not in configs:
        configs.append(default)
    return configs


def refinements(shape: dict, best: list[MatmulConfig]) -> list[MatmulConfig]:
    """Other warp and stage counts for the best tiles of stage 1."""
    out = []
    for c in best:
        for warps, stages in ((4, 2), (4, 4), (8, 3), (8, 4), (8, 2)):
            if warps == 8 and c.block_m * c.block_n < 64 * 64:
                continue  # 8 warps over a small tile: each has too little to do
            if _smem(shape, c.block_m, c.block_n, c.block_k, stages) > SMEM_BYTES:
                continue
            out.append(MatmulConfig(c.block_m, c.block_n, c.block_k, warps, stages, c.split_k))
    return out


# ---- timing ---------------------------------------------------------------------------------


_CYCLES_PER_MS: float | None = None


def _sleep_ms(ms: float) -> None:
    """Keeps the GPU busy about ``ms`` (calibrated once) so that the host's launches queue
    up behind it; a no-op without torch.cuda._sleep."""
    global _CYCLES_PER_MS
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep(1_000_000)  # warm
        start.record()
        sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    sleep(int(ms * _CYCLES_PER_MS))


def time_eager(call, calls: int = 100, rounds: int = 3) -> float:
    """Microseconds a call: the median over ``rounds`` of the mean of ``calls`` calls."""
    for i in range(10):
        call(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        call(i)
    host_ms = (time.perf_counter() - t) * 1e3  # how long the host takes to queue them
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sleep_ms(2 * host_ms + 0.5)
        start.record()
        for i in range(calls):
            call(i)
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(means)


def _graph(calls):
    """A CUDA graph of ``calls()`` (after a warm-up on a side stream, as torch requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(calls, per_replay: int, replays: int = 20, rounds: int = 3) -> float:
    """Microseconds per unit of a graph of ``calls()`` (``per_replay`` units a replay)."""
    graph = _graph(calls)
    means = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sleep_ms(0.5)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) * 1e3 / (replays * per_replay))
    del graph
    return statistics.median(means)


def _graph_of(call, count: int = 20):
    def calls():
        for i in range(count):
            call(i)

    return calls


def mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` is not torch's result up to bf16 rounding (None when it is): a NaN, or an
    error over 2**-5 of |ref| plus its mean magnitude (a wrong tile or a lost K block is
    off by tenths; rounding and summation order by an ulp or so)."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return "non-finite output"
    err = (out - ref).abs()
    bound = 2**-5 * (ref.abs() + ref.abs().mean())
    if (err > bound).any():
        return f"max error {err.max().item():.4g} (bound there {bound.flatten()[err.argmax()]:.4g})"
    return None


# ---- compiling ahead, in parallel -----------------------------------------------------------


_WORKER_OPERANDS: dict = {}


def _compile_one(job: tuple[str, int, dict]) -> bool:
    """In a worker process: runs (shape, m, config) once, which compiles it into Triton's
    on-disk cache. A failure is left for the timing process to record."""
    name, m, config = job
    shape = SHAPES[name]
    ops = _WORKER_OPERANDS.get((name, m))
    if ops is None:
        ops = _WORKER_OPERANDS[(name, m)] = _operands(shape, m, DEVICE)
    try:
        _triton_call(shape, ops, MatmulConfig(**config))(0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the timing process records it
        return False


def stage1_jobs(m_values, device) -> list[tuple[str, int, MatmulConfig]]:
    """Every stage-1 candidate, once per compiled variant: Triton specializes an int
    argument on == 1 and on % 16 == 0, so M = 64 and M = 256 share their kernels."""
    jobs, seen = [], set()
    for name, shape in SHAPES.items():
        for m in m_values:
            for config in candidates(shape, m, device):
                key = (name, config, m == 1, m % 16 == 0)
                if key not in seen:
                    seen.add(key)
                    jobs.append((name, m, config))
    return jobs


def precompile(pool: ProcessPoolExecutor | None, jobs: list[tuple[str, int, MatmulConfig]]):
    """Compiles ``jobs`` in the pool's processes (nothing without a pool); returns when all
    are done, so that no worker runs a kernel while this process times."""
    if pool is None or not jobs:
        return
    # One job a task: whichever worker is free takes the next (compile times vary).
    list(pool.map(_compile_one, [(name, m, asdict(config)) for name, m, config in jobs]))


# ---- the search -----------------------------------------------------------------------------


def _try(shape: dict, ops: dict, config: MatmulConfig, ref: torch.Tensor) -> dict:
    row = {"config": asdict(config), "splits": split_plan(shape["k"], config)[0]}
    try:
        call = _triton_call(shape, ops, config)
        why = mismatch(call(0), ref)
        if why is not None:
            return {**row, "error": f"mismatch: {why}"}
        return {**row, "us": time_eager(call)}
    except Exception as e:  # noqa: BLE001 - out of resources, a compile error: recorded
        return {**row, "error": f"{type(e).__name__}: {str(e)[-300:]}"}


def tune_shape(name: str, m: int, pool: ProcessPoolExecutor | None = None) -> dict:
    shape = SHAPES[name]
    device = torch.device(DEVICE)
    ops = _operands(shape, m, device)
    torch_call = _torch_call(shape, ops)
    ref = torch_call(0)
    result = {"torch_us": time_eager(torch_call)}
    tried = {}
    for config in candidates(shape, m, device):
        tried[config] = _try(shape, ops, config, ref)
    ranked = sorted((c for c in tried if "us" in tried[c]), key=lambda c: tried[c]["us"])
    more = [c for c in refinements(shape, ranked[:4]) if c not in tried]
    precompile(pool, [(name, m, c) for c in more])
    for config in more:
        tried[config] = _try(shape, ops, config, ref)
    ranked = sorted((c for c in tried if "us" in tried[c]), key=lambda c: tried[c]["us"])
    default = default_config(m, shape["n"], shape["k"], device)
    result["configs"] = sorted(tried.values(), key=lambda r: r.get("us", math.inf))
    result["failed"] = sum("error" in r for r in tried.values())
    result["default"] = dict(tried[default])
    # In graphs: torch, the default and the three best by eager time (the best there is
    # "best_graph": one more launch, split-K's, costs differently there).
    result["torch_graph_us"] = time_graph(_graph_of(torch_call), 20)
    if "us" in tried[default]:
        result["default"]["graph_us"] = time_graph(_graph_of(_triton_call(shape, ops, default)), 20)
    top = []
    for config in ranked[:3]:
        graph_us = time_graph(_graph_of(_triton_call(shape, ops, config)), 20)
        top.append({**tried[config], "graph_us": graph_us})
    if top:
        result["best"] = top[0]
        result["best_graph"] = min(top, key=lambda r: r["graph_us"])
    return result


def layer_graph(m: int, configs: dict[str, MatmulConfig | None]) -> dict:
    """The four ops of a layer (distinct inputs, weights cycling as above), 20 layers a
    graph: torch vs the given configs (None: that op's torch call stays)."""
    device = torch.device(DEVICE)
    ops = {name: _operands(shape, m, device) for name, shape in SHAPES.items()}
    torch_calls = [_torch_call(SHAPES[name], ops[name]) for name in SHAPES]
    triton_calls = [
        _torch_call(SHAPES[name], ops[name])
        if configs.get(name) is None
        else _triton_call(SHAPES[name], ops[name], configs[name])
        for name in SHAPES
    ]

    def layers(calls):
        def run():
            for i in range(20):
                for call in calls:
                    call(i)

        return run

    return {
        "torch_us": time_graph(layers(torch_calls), 20),
        "triton_us": time_graph(layers(triton_calls), 20),
    }


def tune(m_values=(64, 256), out=None, *, jobs: int | None = None) -> dict:
    """The search for every shape at every M in ``m_values``; returns the results (and
    writes ``out/rollout_matmul.json`` when ``out`` is given)."""
    import triton

    device = torch.device(DEVICE)
    t0 = time.perf_counter()
    sms = sm_count(device)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "copies": COPIES,
        "m_values": list(m_values),
        "shapes": {name: {} for name in SHAPES},
        "layer_graph": {},
    }
    if jobs is None:
        jobs = min(16, os.cpu_count() or 1)
    pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) if jobs > 1 else None
    try:
        t = time.perf_counter()
        stage1 = stage1_jobs(m_values, device)
        precompile(pool, stage1)
        results["precompile"] = {"jobs": len(stage1), "workers": jobs, "s": time.perf_counter() - t}
        _tune_all(results, m_values, pool, out)
    finally:
        if pool is not None:
            pool.shutdown()
    results["total_s"] = time.perf_counter() - t0
    _save(results, out)
    return results


def _tune_all(results: dict, m_values, pool, out) -> None:
    """Every shape at every M, then the layer graphs; an error is recorded where it
    happened and the rest goes on. The JSON is rewritten after each step."""
    for m in m_values:
        best, default = {}, {}
        for name in SHAPES:
            t = time.perf_counter()
            try:
                found = tune_shape(name, m, pool)
            except Exception as e:  # noqa: BLE001 - the other shapes still run
                found = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
            found["tune_s"] = time.perf_counter() - t
            results["shapes"][name][str(m)] = found
            if "best_graph" in found:
                best[name] = MatmulConfig(**found["best_graph"]["config"])
            if "us" in found.get("default", {}):
                default[name] = MatmulConfig(**found["default"]["config"])
            print(_row(name, m, found), flush=True)
            _save(results, out)
        try:
            layer = {"best": layer_graph(m, best), "default": layer_graph(m, default)}
            print(_layer_row(m, layer), flush=True)
        except Exception as e:  # noqa: BLE001
            layer = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
            print(f"layer graph, M={m}: {layer['error']}", flush=True)
        results["layer_graph"][str(m)] = layer
        _save(results, out)


def _save(results: dict, out) -> None:
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "rollout_matmul.json").write_text(json.dumps(results, indent=1))


# ---- the table ------------------------------------------------------------------------------

HEADER = (
    f"{'shape':8s} {'M':>4s}  {'torch':>6s} {'graph':>6s} | {'best':>6s} {'graph':>6s} "
    f"{'(best in graph)':>15s} | {'default':>7s} {'graph':>6s} | best config (bm bn bk w s split)"
)


def _cfg(row: dict | None) -> str:
    if not row:
        return "-"
    c = row["config"]
    return (
        f"{c['block_m']} {c['block_n']} {c['block_k']} {c['num_warps']} {c['num_stages']} "
        f"{c['split_k']}"
    )


def _us(value) -> str:
    return f"{value:6.2f}" if isinstance(value, int | float) else f"{'-':>6s}"


def _row(name: str, m: int, found: dict) -> str:
    if "error" in found:
        return f"{name:8s} {m:4d}  failed: {found['error']}"
    best, best_graph, default = found.get("best"), found.get("best_graph"), found["default"]
    return (
        f"{name:8s} {m:4d}  {_us(found['torch_us'])} {_us(found['torch_graph_us'])} | "
        f"{_us(best and best['us'])} {_us(best and best['graph_us'])} "
        f"{_us(best_graph and best_graph['graph_us']):>15s} | "
        f"{_us(default.get('us')):>7s} {_us(default.get('graph_us'))} | {_cfg(best)}"
        f"{'' if best_graph is best else ' (graph: ' + _cfg(best_graph) + ')'}"
        f"  [{found['failed']} failed]"
    )


def _layer_row(m: int, layer: dict) -> str:
    return (
        f"layer of 4 ops in a graph, M={m}: torch {layer['best']['torch_us']:.2f} us, "
        f"best configs {layer['best']['triton_us']:.2f} us, "
        f"defaults {layer['default']['triton_us']:.2f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--m", default="64,256", help="row counts, comma-separated")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (0: none)")
    args = parser.parse_args()
    print(HEADER, flush=True)
    results = tune(tuple(int(m) for m in args.m.split(",")), args.out, jobs=args.jobs)
    print(f"precompile: {results['precompile']}; total {results['total_s']:.1f} s")


if __name__ == "__main__":
    main()
