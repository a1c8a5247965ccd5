"""The decode attention kernel's launch choices on the GPU: keys per iteration, warps,
pipeline stages and key splits, each checked against the default launch and timed as 24
calls (one per layer, each over its own layer's cache) replayed in a CUDA graph.

    python3 -m benchmarks.gpu_attention --out $OUT

Shapes: the Qwen2.5-0.5B decode step at 256 rows (14 query heads over 2 kv heads of 64),
rope and the cache write inside the kernel (``decode_attention_rope``, the engine's path),
slots of 1,024 positions; rows at positions 256..511 (width 512) and 512..1,023 (width
1,024: the second half of a 512 + 512 rollout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from services.rollout.kernels import attention

LAYERS, ROWS, HEADS, KV_HEADS, HEAD_DIM, SLOT_LEN = 24, 256, 14, 2, 64, 1024


def _inputs(low: int, high: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    angles = torch.arange(SLOT_LEN, device="cuda")[:, None] * torch.rand(
        HEAD_DIM, generator=g, device="cuda"
    )
    return {
        "q": randn(ROWS, HEADS, HEAD_DIM),
        "k": randn(ROWS, KV_HEADS, HEAD_DIM),
        "v": randn(ROWS, KV_HEADS, HEAD_DIM),
        "cos": angles.cos().to(**bf16),
        "sin": angles.sin().to(**bf16),
        "positions": torch.randint(low, high, (ROWS,), generator=g, device="cuda"),
        "k_cache": randn(LAYERS, ROWS, KV_HEADS, SLOT_LEN, HEAD_DIM),
        "v_cache": randn(LAYERS, ROWS, KV_HEADS, SLOT_LEN, HEAD_DIM),
    }


def _layer(x: dict, i: int, width: int, splits: int | None) -> torch.Tensor:
    return attention.decode_attention_rope(
        x["q"],
        x["k"],
        x["v"],
        x["cos"],
        x["sin"],
        x["positions"],
        x["k_cache"][i],
        x["v_cache"][i],
        0.125,
        width,
        num_splits=splits,
    )


def _time_graph(x: dict, width: int, splits: int | None, replays: int = 20) -> float:
    """Microseconds per call: 24 calls captured in one graph, replayed."""
    for i in range(LAYERS):  # compile and warm up outside the capture
        _layer(x, i, width, splits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            _layer(x, i, width, splits)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * LAYERS)


def sweep(
    blocks=(32, 64, 128),
    warps=(4, 8),
    stages=(1, 2, 3, 4),
    splits=(None, 2, 4),
    widths=((256, 512, 512), (512, 1023, 1024)),
) -> dict:
    out: dict = {"rows": [], "shapes": [list(w) for w in widths]}
    default = attention.LAUNCH
    try:
        for low, high, width in widths:
            x = _inputs(low, high)
            attention.LAUNCH = default
            want = _layer(x, 0, width, None).float()
            base_us = _time_graph(x, width, None)
            out[f"default_us_w{width}"] = base_us
            for block, w, st, sp in itertools.product(blocks, warps, stages, splits):
                row = {"width": width, "block_keys": block, "warps": w, "stages": st}
                row["splits"] = sp or 1
                attention.LAUNCH = attention.AttentionLaunch(block, w, st)
                try:
                    got = _layer(x, 0, width, sp).float()
                    row["max_diff"] = float((got - want).abs().max())
                    row["us"] = _time_graph(x, width, sp)
                    row["speedup"] = base_us / row["us"]
                except Exception as e:  # noqa: BLE001 - a config that fails to compile
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        attention.LAUNCH = default
    for width in {w for _, _, w in widths}:
        ok = [r for r in out["rows"] if r["width"] == width and "us" in r and r["max_diff"] < 2e-2]
        if ok:
            out[f"best_w{width}"] = min(ok, key=lambda r: r["us"])
    return out


def by_width(widths=(128, 256, 512, 1024)) -> dict:
    """The default launch's µs per call with rows at positions in the upper half of each
    width, and the bytes of keys and values it reads per µs: a fixed cost per program
    shows as a time that falls slower than the width."""
    out = {}
    for width in widths:
        x = _inputs(width // 2, width)
        us = _time_graph(x, width, None)
        keys = float((x["positions"].clamp(max=width - 1) + 1).sum())
        read = keys * KV_HEADS * HEAD_DIM * 2 * x["k_cache"].element_size()
        out[f"w{width}"] = {"us": us, "gb_per_s": read / us / 1e3}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--splits", default="1,2,4", help="1: split_count's choice")
    parser.add_argument("--by-width", action="store_true", help="also time the default by width")
    args = parser.parse_args()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(v) for v in text.split(","))

    start = time.monotonic()
    result = sweep(
        blocks=ints(args.blocks),
        warps=ints(args.warps),
        stages=ints(args.stages),
        splits=tuple(v if v > 1 else None for v in ints(args.splits)),
    )
    if args.by_width:
        result["by_width"] = by_width()
    result["total_s"] = time.monotonic() - start
    result["gpu"] = torch.cuda.get_device_name()
    Path(args.out, "gpu_attention.json").write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k != "rows"})


if __name__ == "__main__":
    main()
