"""Split-K projections whose partial sums the next kernel adds up (H200).

    python3 -m benchmarks.rollout.split_k --out $OUT [--sections sweep,layer,engine]

At 256 rows a decode step's q/k/v and o projections (K = 896) make few output tiles, and
each tile's program walks all of K one block after another: cuBLAS takes 4 to 6 us for
2 MB of weights. Split over K they make several times the programs, each walking a few
blocks, but the float32 partials must then be summed. The residual add + RMSNorm after
o_proj and down_proj reads their outputs anyway, so it can sum the partials where it loads
them (``kernels.add_rms_norm_partials``): no reduction kernel of its own.

Sections:
- ``sweep``: for q/k/v, o and down at 64 and 256 rows, torch (cuBLAS) against
  ``kernels.linear_partials`` over tiles and splits, each in a CUDA graph of 20 calls
  (weights cycling through sets larger than L2), the partials checked against F.linear
  first.
- ``layer``: a layer's projections and the kernels between them (no attention), 20 layers
  a graph, with the sweep's best configs: (A) the engine's ops today; (B) o and down split,
  their partials summed by the add + norm; (C) B with q/k/v split too, reduced by a kernel
  of its own (what it costs without a consumer that sums them); (D) B with q/k/v's
  partials not summed at all (the bound for an attention kernel that would sum them). Each
  variant's layer output is checked against A's first.
- ``engine``: the decoder's ``split_projections`` (B in the engine, tiled by
  ``kernels.partial_config``) off and on at each row bucket: logits of one decode step
  against the other's, the decode graph's time a step; ``calls``: then whole calls of both,
  interleaved at batches 256 and 64. (At 2445eaa also with SiLU x up computed inside
  down_proj's GEMM: 1.37x slower, removed.)

Writes ``$OUT/rollout_split_k.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.rollout.matmul import (
    COPIES,
    DTYPE,
    SHAPES,
    SMEM_BYTES,
    _operands,
    mismatch,
    time_graph,
)
from services.rollout.fast import kernels
from services.rollout.fast.fused_ops import FusedOps
from services.rollout.fast.kernels.matmul import MatmulConfig, split_plan
from services.rollout.fast.kernels.runtime import cdiv

RESULTS: dict = {}
SPLIT_SHAPES = ("qkv", "o", "down")
HIDDEN = 896
EPS = 1e-6


def candidates(name: str, m: int) -> list[MatmulConfig]:
    """Tiles of 32/64 rows (64/128 at M >= 128), 32/64/128 columns, K steps of 64/128,
    splits 1/2/4/7 of K = 896 or 2/4/8/16 of down's 4,864, 3 or 4 pipeline stages."""
    shape = SHAPES[name]
    k = shape["k"]
    out = []
    for bm in (64, 128) if m >= 128 else (32, 64):
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4, 7) if k < 2048 else (2, 4, 8, 16):
                    if cdiv(k, bk) < split:
                        continue
                    for stages in (3, 4):
                        if stages * (bm + bn) * bk * DTYPE.itemsize > SMEM_BYTES:
                            continue
                        out.append(MatmulConfig(bm, bn, bk, 4, stages, split))
    return out


def _compile_one(job) -> bool:
    name, m, config = job
    try:
        ops = _operands(SHAPES[name], m, "cuda")
        kernels.linear_partials(ops["x"], ops["weights"][0], MatmulConfig(**config))
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the timing process records it
        return False


def _calls_us(call) -> float:
    """Microseconds a call of ``call(i)`` in a graph of 20 (i = 0..19)."""
    return time_graph(lambda: [call(i) for i in range(20)], 20)


def _layers_us(layer, lo: dict) -> float:
    """Microseconds a layer in a graph of 20 layers, each's output the next one's input."""

    def layers():
        x, h = lo["x"], lo["h"]
        for i in range(20):
            x, h = layer(x, h, i)

    return time_graph(layers, 20)


def sweep(jobs: int = 16) -> dict:
    todo, seen = [], set()
    for name in SPLIT_SHAPES:
        for m in (256, 64):
            for config in candidates(name, m):
                if (name, config) not in seen:
                    seen.add((name, config))
                    todo.append((name, m, asdict(config)))
    t = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        list(pool.map(_compile_one, todo))
    out = {"precompile": {"configs": len(todo), "s": time.perf_counter() - t}}
    for name in SPLIT_SHAPES:
        shape = SHAPES[name]
        for m in (256, 64):
            ops = _operands(shape, m, "cuda")
            x, weights, biases = ops["x"], ops["weights"], ops["biases"]
            ref = F.linear(x, weights[0])
            row = {
                "torch_graph_us": _calls_us(
                    lambda i, x=x, w=weights, b=biases: F.linear(x, w[i % COPIES], b[i % COPIES])
                ),
                "configs": [],
            }
            for config in candidates(name, m):
                entry = {"config": asdict(config), "splits": split_plan(shape["k"], config)[0]}
                try:
                    parts = kernels.linear_partials(x, weights[0], config)
                    why = mismatch(parts.sum(0).to(DTYPE), ref)
                    if why:
                        entry["error"] = why
                    else:
                        entry["graph_us"] = _calls_us(
                            lambda i, x=x, w=weights, c=config: kernels.linear_partials(
                                x, w[i % COPIES], c
                            )
                        )
                except Exception as e:  # noqa: BLE001
                    entry["error"] = f"{type(e).__name__}: {str(e)[-200:]}"
                row["configs"].append(entry)
            timed = [c for c in row["configs"] if "graph_us" in c]
            timed.sort(key=lambda c: c["graph_us"])
            row["best"] = timed[:5]
            row["failed"] = len(row["configs"]) - len(timed)
            del row["configs"]
            out[f"{name}_{m}"] = row
            best = row["best"][0] if row["best"] else None
            print(
                f"{name:5s} M={m:3d}: torch {row['torch_graph_us']:.2f} us, partials "
                + (f"{best['graph_us']:.2f} us {best['config']}" if best else "none")
                + f" [{row['failed']} failed]",
                flush=True,
            )
    return out


def best_configs(found: dict, m: int) -> dict[str, MatmulConfig]:
    out = {}
    for name in SPLIT_SHAPES:
        best = found.get(f"{name}_{m}", {}).get("best")
        if best:
            out[name] = MatmulConfig(**best[0]["config"])
    return out


def _layer_ops(m: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(7)
    ops = {name: _operands(SHAPES[name], m, "cuda") for name in SHAPES}
    norms = [
        (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).to(DTYPE)
        for _ in range(2 * COPIES)
    ]
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(DTYPE)
    h = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(DTYPE)
    attn = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(DTYPE)
    return dict(ops=ops, norms=norms, x=x, h=h, attn=attn)


def _layer_fn(variant: str, lo: dict, configs: dict, fused: FusedOps):
    """One layer's projections as ``variant`` runs them: (x, h, i) -> (x, h)."""
    ops, norms = lo["ops"], lo["norms"]
    wqkv, bqkv = ops["qkv"]["weights"], ops["qkv"]["biases"]
    wo, wgu, wd = ops["o"]["weights"], ops["gate_up"]["weights"], ops["down"]["weights"]

    def layer(x, h, i):
        c = i % COPIES
        if variant in ("A", "B"):
            qkv = F.linear(h, wqkv[c], bqkv[c])
        elif variant == "C":
            qkv = kernels.linear(h, wqkv[c], bqkv[c], config=configs["qkv"])
        else:  # D: the partials are written and never summed
            qkv = kernels.linear_partials(h, wqkv[c], configs["qkv"])
        # Attention's output stands in as a fixed tensor plus a dependence on q/k/v, so
        # the chain of kernels stays in order.
        first = qkv[0] if variant == "D" else qkv
        a = lo["attn"] + first[:, :1].to(DTYPE) * 0
        if variant == "A":
            x, h = fused.add_rms_norm(x, F.linear(a, wo[c]), norms[2 * c], EPS)
        else:
            parts = kernels.linear_partials(a, wo[c], configs["o"])
            x, h = kernels.add_rms_norm_partials(x, parts, norms[2 * c], EPS)
        act = kernels.silu_mul_halves(F.linear(h, wgu[c]))
        if variant == "A":
            x, h = fused.add_rms_norm(x, F.linear(act, wd[c]), norms[2 * c + 1], EPS)
        else:
            parts = kernels.linear_partials(act, wd[c], configs["down"])
            x, h = kernels.add_rms_norm_partials(x, parts, norms[2 * c + 1], EPS)
        return x, h

    return layer


def layer_section(found: dict) -> dict:
    fused = FusedOps(compile=True)
    out = {}
    for m in (256, 64):
        configs = best_configs(found, m)
        if set(configs) != set(SPLIT_SHAPES):
            out[str(m)] = {"error": f"no config for some of {SPLIT_SHAPES}: {sorted(configs)}"}
            continue
        lo = _layer_ops(m)
        row = {"configs": {k: asdict(v) for k, v in configs.items()}}
        ref_x, ref_h = _layer_fn("A", lo, configs, fused)(lo["x"], lo["h"], 0)
        for variant in ("A", "B", "C", "D"):
            fn = _layer_fn(variant, lo, configs, fused)
            x, h = fn(lo["x"], lo["h"], 0)
            check = {
                "x_max_abs": (x.float() - ref_x.float()).abs().max().item(),
                "h_max_abs": (h.float() - ref_h.float()).abs().max().item(),
                "h_mean_abs": (h.float() - ref_h.float()).abs().mean().item(),
                "h_scale": ref_h.float().abs().mean().item(),
            }
            row[variant] = {"check": check, "us_per_layer": _layers_us(fn, lo)}
        for variant in ("A", "B", "C", "D", "A", "B"):  # again, interleaved
            fn = _layer_fn(variant, lo, configs, fused)
            row.setdefault(f"{variant}_again", []).append(_layers_us(fn, lo))
        out[str(m)] = row
        print(
            f"layer M={m}: "
            + ", ".join(f"{v} {row[v]['us_per_layer']:.2f} us" for v in "ABCD")
            + f"; again A {row['A_again']} B {row['B_again']}",
            flush=True,
        )
    return out


def _cuda_us(fn, count: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(count):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / count


BUCKETS = (16, 32, 64, 96, 128, 192, 256)


ENGINE_VARIANTS = {
    # name: decoder.split_projections (at 2445eaa also "split_silu": SiLU x up computed in
    # down_proj's GEMM, the decoder's silu_in_down; 1.37x slower, removed)
    "whole": False,
    "split": True,
}


def engine_section(workdir: str, calls: bool = True) -> dict:
    """The decoder's ``split_projections`` (variant B, with ``kernels.partial_config``'s
    tiling) off and on: at each row bucket one decode step's logits against the "whole"
    one's and the decode graph's time a step (interleaved twice); then (``calls``) whole
    calls of "whole" and the default at batches 256 and 64, interleaved."""
    from benchmarks.rollout import engine as ge
    from benchmarks.rollout.engine_breakdown import Call

    engine = ge.qwen05_engine(workdir)
    decoder = engine.decoder
    default = decoder.split_projections

    def use(split: bool):
        decoder.split_projections = split
        engine.graphs.clear()

    out = {}
    try:
        for batch in BUCKETS:
            call = Call(engine, batch, 256, 256)
            call.admit()
            call.steps(128)  # 384 positions
            torch.cuda.synchronize()
            bs, width = call.step_shape()
            tokens, positions = call.state.last_tokens[:bs], call.state.positions[:bs]
            logits = {}
            for name, settings in ENGINE_VARIANTS.items():
                use(settings)
                logits[name] = decoder.decode(tokens, positions, call.kv.k, call.kv.v, width)
            row = {"rows": bs, "width": width, "step_us": {}}
            for name in ENGINE_VARIANTS:
                diff = (logits[name].float() - logits["whole"].float()).abs()
                same = logits[name].argmax(-1) == logits["whole"].argmax(-1)
                row[f"{name}_logits"] = {
                    "max_abs": diff.max().item(),
                    "mean_abs": diff.mean().item(),
                    "argmax_agree": same.float().mean().item(),
                }
            for _ in range(2):
                for name, settings in ENGINE_VARIANTS.items():
                    use(settings)
                    call.graph_steps(1)
                    row["step_us"].setdefault(name, []).append(
                        _cuda_us(lambda c=call: c.graph_steps(1), 50)
                    )
            best = {name: min(us) for name, us in row["step_us"].items()}
            row["speedup_vs_whole"] = {name: best["whole"] / us for name, us in best.items()}
            out[f"b{batch}"] = row
            print(
                f"engine b{batch} (width {width}): "
                + ", ".join(f"{n} {us:.1f} us" for n, us in best.items())
                + f"; argmax vs whole {row['split_logits']['argmax_agree']:.3f}",
                flush=True,
            )
        if calls:
            for batch, rounds in ((256, 3), (64, 2)):
                timed = []
                for _ in range(rounds):
                    for settings in (ENGINE_VARIANTS["whole"], default):
                        use(settings)
                        speed = ge.engine_speed(engine, batch, 256, 256, False)
                        timed.append({"settings": settings, "tok_s": speed["tok_s"]})
                out[f"calls_b{batch}"] = timed
                pairs = [timed[i + 1]["tok_s"] / timed[i]["tok_s"] for i in range(0, len(timed), 2)]
                print(f"calls b{batch} default/whole: {[round(r, 3) for r in pairs]}", flush=True)
    finally:
        use(default)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--sections", default="sweep,layer,engine,calls")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__

    def save():
        (out / "rollout_split_k.json").write_text(json.dumps(RESULTS, indent=1, default=str))

    t0 = time.perf_counter()
    found = {}
    if "sweep" in sections:
        RESULTS["sweep"] = found = sweep()
        save()
    if "layer" in sections:
        try:
            RESULTS["layer"] = layer_section(found)
        except Exception as e:  # noqa: BLE001
            RESULTS["layer"] = {"error": f"{type(e).__name__}: {e}"}
            print("layer:", RESULTS["layer"], flush=True)
        save()
    if "engine" in sections:
        with tempfile.TemporaryDirectory() as workdir:
            try:
                RESULTS["engine"] = engine_section(workdir, calls="calls" in sections)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                RESULTS["engine"] = {"error": f"{type(e).__name__}: {e}"}
        save()
    RESULTS["total_s"] = time.perf_counter() - t0
    save()
    print(f"total {RESULTS['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
