"""The decode step cut into row groups on parallel streams (``split_decode.py``) against
the whole batch on one stream, on the GPU.

First the check: each split's captured step against the plain eager step on the same
random cache, tokens and positions (max |logit difference|, argmax agreement). Then the
step alone (graph replays, CUDA events, the variants interleaved) and whole generate calls
(``gpu_engine.engine_speed``, interleaved) at each setting.

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_decode_split --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import gpu_engine as ge
from benchmarks.gpu_models import make_model_dir
from services.rollout.fast_engine import FastEngine


def _fill_cache(engine: FastEngine, rows: int, slot_len: int, seed: int):
    """A cache view of ``rows`` slots holding random keys/values (as a prefill leaves)."""
    kv = engine.cache.view(slot_len, rows)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in (kv.k, kv.v):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
    return kv


def _inputs(engine: FastEngine, rows: int, low: int, high: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(10, engine.vocab_size, (rows,), generator=g, device="cuda")
    positions = torch.randint(low, high, (rows,), generator=g, device="cuda")
    return tokens, positions


def check_splits(engine: FastEngine, rows: int, width: int, parts_list) -> dict:
    """Each split's captured step against the plain eager step (same inputs, same cache)."""
    kv = _fill_cache(engine, rows, width, seed=rows)
    tokens, positions = _inputs(engine, rows, width - 128, width, seed=rows + 1)
    plain = engine.decoder.decode(tokens, positions, kv.k, kv.v, width).float()
    out = {}
    for parts in parts_list:
        engine.graphs.split_parts = parts
        logits = engine.graphs.run(tokens, positions, kv, width).float()
        out[f"parts{parts}"] = {
            "max_abs_diff": (logits - plain).abs().max().item(),
            "argmax_agree": (logits.argmax(-1) == plain.argmax(-1)).float().mean().item(),
        }
    engine.graphs.split_parts = 1
    engine.graphs.clear()
    return out


def step_us(engine: FastEngine, rows: int, width: int, parts_list, rounds: int = 3) -> dict:
    """Microseconds per decode step (graph replay, inputs copied in) for each split,
    interleaved ``rounds`` times; median per setting."""
    kv = _fill_cache(engine, rows, width, seed=7)
    tokens, positions = _inputs(engine, rows, width - 128, width, seed=8)
    times: dict[int, list[float]] = {p: [] for p in parts_list}
    for _ in range(rounds):
        for parts in parts_list:
            engine.graphs.split_parts = parts
            for _ in range(10):  # the first captures
                engine.graphs.run(tokens, positions, kv, width)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            for _ in range(200):
                engine.graphs.run(tokens, positions, kv, width)
            end.record()
            end.synchronize()
            times[parts].append(start.elapsed_time(end) * 1000 / 200)
    engine.graphs.split_parts = 1
    engine.graphs.clear()
    base = statistics.median(times[1]) if 1 in times else None
    out = {}
    for parts, ts in times.items():
        med = statistics.median(ts)
        out[f"parts{parts}"] = {"us": med, "all_us": ts}
        if base:
            out[f"parts{parts}"]["speedup"] = base / med
    return out


def generate_ab(engine: FastEngine, batch: int, parts_list, repeats: int = 2) -> dict:
    """Whole generate calls (256 + 256 tokens, T = 1) at each split, interleaved."""
    out = {}
    for rep in range(repeats):
        for parts in parts_list:
            engine.graphs.split_parts = parts
            engine.graphs.clear()
            out[f"parts{parts}_{rep}"] = ge.engine_speed(engine, batch, 256, 256, False)
    engine.graphs.split_parts = 1
    engine.graphs.clear()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    parser.add_argument("--parts", default="1,2,4")
    parser.add_argument("--min-rows", type=int, default=64)
    args = parser.parse_args()
    parts_list = [int(p) for p in args.parts.split(",")]
    out_path = Path(args.out) / "gpu_decode_split.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:
        out_path.write_text(json.dumps(results, indent=1))

    def run(name, fn) -> None:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections' figures
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        if isinstance(results[name], dict):
            results[name]["wall_s"] = time.perf_counter() - start
        print(name, json.dumps(results[name])[:600], flush=True)
        save()

    engine = FastEngine(
        make_model_dir(f"{args.workdir}/qwen05_bf16"),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=256,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
    )
    engine.graphs.split_min_rows = args.min_rows
    for rows, width in ((256, 384), (256, 512), (64, 512)):
        run(
            f"check_b{rows}_w{width}",
            lambda r=rows, w=width: check_splits(engine, r, w, parts_list),
        )
    for rows, width in ((256, 384), (256, 512), (128, 512), (64, 512)):
        run(f"step_b{rows}_w{width}", lambda r=rows, w=width: step_us(engine, r, w, parts_list))
    run("generate_b256", lambda: generate_ab(engine, 256, parts_list))
    run("generate_b64", lambda: generate_ab(engine, 64, parts_list[:2], repeats=1))


if __name__ == "__main__":
    main()
