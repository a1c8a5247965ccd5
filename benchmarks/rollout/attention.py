"""The decode attention kernel's launch choices on the GPU: keys per iteration, warps,
pipeline stages and key splits, each checked against the default launch and timed as 24
calls (one per layer, each over its own layer's cache) replayed in a CUDA graph.

    python3 -m benchmarks.rollout.attention --out $OUT

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

from services.rollout.fast.kernels import attention
from services.rollout.fast.kernels.runtime import tl

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


def _stream_kernel(
    k_ptr, v_ptr, stride_slot, stride_head, stride_pos, positions_ptr, out_ptr, width,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Reads what the attention kernel reads of one (row, kv head): its keys and values
    up to position + 1 (clamped to width), summed; nothing else. A floor for the access."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    length = tl.minimum(tl.load(positions_ptr + row) + 1, width)
    base = row * stride_slot + head * stride_head
    dim = tl.arange(0, HEAD_DIM)
    key_in_block = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        key = start + key_in_block
        ok = (key < length)[:, None]
        at = base + key[:, None] * stride_pos + dim[None, :]
        acc += tl.load(k_ptr + at, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * 2 + head, tl.sum(tl.sum(acc, 1), 0))


def stream_floor(block_n=(64, 128, 256), stages=(1, 2, 3), low=256, high=384, width=384) -> dict:
    """µs per call of :func:`_stream_kernel` (24 calls over 24 layers' caches in a graph)
    against the attention kernel's default launch on the same rows and positions."""
    import triton as _triton

    kernel = _triton.jit(_stream_kernel)
    x = _inputs(low, high)
    out = torch.empty(ROWS * KV_HEADS, device="cuda", dtype=torch.float32)
    kc, vc = x["k_cache"], x["v_cache"]
    result = {"attention_us": _time_graph(x, width, None)}
    for bn, st in itertools.product(block_n, stages):

        def calls(bn=bn, st=st):
            for i in range(LAYERS):
                k, v = kc[i], vc[i]
                kernel[(ROWS, KV_HEADS)](
                    k, v, k.stride(0), k.stride(1), k.stride(2), x["positions"], out, width,
                    BLOCK_N=bn, HEAD_DIM=HEAD_DIM, num_warps=4, num_stages=st,
                )  # fmt: skip

        calls()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        result[f"stream_bn{bn}_st{st}_us"] = start.elapsed_time(end) * 1e3 / (20 * LAYERS)
    keys = float((x["positions"].clamp(max=width - 1) + 1).sum())
    result["bytes_per_call"] = keys * KV_HEADS * HEAD_DIM * 2 * kc.element_size()
    return result


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
    parser.add_argument("--floor-only", action="store_true", help="only the streaming floor")
    args = parser.parse_args()
    if args.floor_only:
        result = stream_floor()
        print(json.dumps(result))
        Path(args.out, "rollout_attention_floor.json").write_text(json.dumps(result, indent=1))
        return

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
    Path(args.out, "rollout_attention.json").write_text(json.dumps(result, indent=1))
    print({k: v for k, v in result.items() if k != "rows"})


if __name__ == "__main__":
    main()
