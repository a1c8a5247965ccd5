"""How much of a decode step's GEMM time is waiting for weights from HBM, and whether
prefetching the next weights into L2 (on a side branch of the step's graph) wins it back.

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_l2_prefetch --out $OUT

Sections:
- ``chain``: the 24 layers' four projections (q/k/v, o, gate/up, down) alone, in a graph,
  at 256 and 64 rows: distinct weights (cold), one layer's weights 24 times (hot: the bound
  of what L2 could give), and distinct weights with the next layer's prefetched into L2.
- ``step``: the engine's decode step graph (256 and 64 rows, width 384) with the same
  variants, the attention's key/value loads with and without an evict-first hint; the
  logits of every variant checked against the default's first.
- ``e2e``: whole generate calls of the best prefetch variant against the default, in turn.

The prefetch is ``cp.async.bulk.prefetch.L2`` (sm_90): one instruction per 32 KB chunk, no
registers, no shared memory, so a few programs issue a layer's 30 MB and leave the SMs to
the step's own kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import gpu_engine as ge
from benchmarks.gpu_engine_breakdown import Call, _cuda_ms
from services.rollout.kernels import attention as attention_module
from services.rollout.kernels.runtime import tl, triton

CHUNK = 32 * 1024
LANES = 128

_ASM = {
    # $0: an unused result (inline asm must have one), $1: address, $2: bytes (0: skip)
    "evict_last": (
        "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
        "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }"
    ),
    "normal": (
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
    ),
}


@triton.jit
def _prefetch_range(
    base, nbytes, chunk0, CHUNK: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr
):
    offs = (chunk0 + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.where(offs < nbytes, tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        ASM, "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_kernel(
    p0, n0, p1, n1, p2, n2, p3, n3, CHUNK: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr
):
    """Program (i, j): chunks [i * LANES, (i + 1) * LANES) of buffer j, one a lane."""
    chunk0 = tl.program_id(0) * LANES
    which = tl.program_id(1)
    if which == 0:
        _prefetch_range(p0, n0, chunk0, CHUNK, LANES, ASM)
    elif which == 1:
        _prefetch_range(p1, n1, chunk0, CHUNK, LANES, ASM)
    elif which == 2:
        _prefetch_range(p2, n2, chunk0, CHUNK, LANES, ASM)
    else:
        _prefetch_range(p3, n3, chunk0, CHUNK, LANES, ASM)


def prefetch_l2(tensors: list[torch.Tensor], policy: str = "evict_last") -> None:
    """Starts pulling up to four contiguous tensors into L2; returns at once (async)."""
    tensors = (tensors + [tensors[0]] * 4)[:4] if len(tensors) < 4 else tensors
    args = []
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
        nbytes = t.numel() * t.element_size()
        args += [t.view(torch.uint8).view(-1), nbytes - nbytes % 16]
    most = max(args[1::2])
    grid = (triton.cdiv(triton.cdiv(most, CHUNK), LANES), 4)
    _prefetch_kernel[grid](*args, CHUNK=CHUNK, LANES=LANES, ASM=_ASM[policy], num_warps=LANES // 32)


# ---------------------------------------------------------------- the projections alone


def _layer_weights(layers: int, device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02

    return [
        {"qkv": w(1152, 896), "o": w(896, 896), "gate_up": w(9728, 896), "down": w(896, 4864)}
        for _ in range(layers)
    ]


def chain(rows: int, layers: int = 24) -> dict:
    device = torch.device("cuda")
    weights = _layer_weights(layers, device)
    x = torch.randn(rows, 896, device=device, dtype=torch.bfloat16)
    act = torch.randn(rows, 4864, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def run(ws, prefetch: str | None):
        main = torch.cuda.current_stream()
        for i, w in enumerate(ws):
            if prefetch and i + 1 < len(ws):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch_l2(list(ws[i + 1].values()), prefetch)
            F.linear(x, w["qkv"])
            F.linear(x, w["o"])
            F.linear(x, w["gate_up"])
            F.linear(act, w["down"])
        if prefetch:  # join the side branch (only a forked stream may be waited on)
            main.wait_stream(side)

    variants = {
        "cold": (weights, None),
        "hot": ([weights[0]] * layers, None),
        "cold_prefetch_evict_last": (weights, "evict_last"),
        "cold_prefetch_normal": (weights, "normal"),
    }
    out = {}
    for name, (ws, prefetch) in variants.items():
        run(ws, prefetch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(ws, prefetch)
        out[name] = _cuda_ms(graph.replay, 15) * 1e3 / layers  # µs a layer
    # the same again, to bound the noise
    return {f"{name}_us_per_layer": v for name, v in out.items()}


# ---------------------------------------------------------------- the engine's step


def _decode_with_prefetch(decoder, where: str, policy: str):
    """``StaticDecoder.decode`` with a side branch per layer that prefetches weights into
    L2. ``where``: "layer_ahead" (at layer i's start, all of layer i+1's weights) or
    "attention" (after layer i's q/k/v: its o, gate/up, down and layer i+1's q/k/v)."""
    side = torch.cuda.Stream()

    def weights(i):
        f = decoder.fused[i]
        mlp = decoder.layers[i].mlp
        return {
            "qkv": f.qkv_weight,
            "o": decoder.layers[i].self_attn.o_proj.weight,
            "gate_up": f.gate_up_weight,
            "down": mlp.down_proj.weight,
        }

    def fork(tensors):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch_l2(tensors, policy)

    @torch.inference_mode()
    def decode(tokens, positions, k_cache, v_cache, width):
        bs = tokens.shape[0]
        ops = decoder.ops
        cos_t, sin_t = decoder.rope_table(width)
        x = decoder.embed(tokens)
        h = ops.rms_norm(x, decoder.layers[0].input_layernorm.weight, decoder.eps)
        attend = decoder._triton_attention(positions, k_cache, v_cache, cos_t, sin_t, width)
        n = len(decoder.layers)
        for i, layer in enumerate(decoder.layers):
            if where == "layer_ahead" and i + 1 < n:
                fork(list(weights(i + 1).values()))
            q, k, v = decoder._qkv(i, h, (bs,))
            if where == "attention":
                w = weights(i)
                ahead = [weights(i + 1)["qkv"]] if i + 1 < n else []
                fork([w["o"], w["gate_up"], w["down"], *ahead])
            o = attend(i, q, k, v)
            o_proj = layer.self_attn.o_proj
            o = decoder._linear(o.reshape(bs, -1), o_proj.weight, o_proj.bias)
            x, h = ops.add_rms_norm(x, o, layer.post_attention_layernorm.weight, decoder.eps)
            x, h = ops.add_rms_norm(
                x, decoder._mlp(i, h), decoder._next_norm_weight(i), decoder.eps
            )
        torch.cuda.current_stream().wait_stream(side)
        return decoder.lm_head(h)

    return decode


@dataclasses.dataclass
class Variant:
    aliased: bool = False  # every layer reads layer 0's weights (the L2 bound)
    prefetch: str | None = None  # "layer_ahead", "attention"
    policy: str = "evict_last"
    kv_eviction: str = ""


VARIANTS = {
    "default": Variant(),
    "kv_evict_first": Variant(kv_eviction="evict_first"),
    "aliased": Variant(aliased=True),
    "aliased_kv_evict_first": Variant(aliased=True, kv_eviction="evict_first"),
    "ahead_evict_last": Variant(prefetch="layer_ahead"),
    "ahead_evict_last_kv_first": Variant(prefetch="layer_ahead", kv_eviction="evict_first"),
    "attention_evict_last": Variant(prefetch="attention"),
    "attention_evict_last_kv_first": Variant(prefetch="attention", kv_eviction="evict_first"),
    "attention_normal_kv_first": Variant(
        prefetch="attention", policy="normal", kv_eviction="evict_first"
    ),
}


class Applied:
    """Puts a variant on the engine's decoder (and takes it off again)."""

    def __init__(self, engine, variant: Variant):
        self.engine, self.variant = engine, variant

    def __enter__(self):
        d = self.engine.decoder
        self.saved = (d.layers, d.fused, d.__dict__.get("decode"), attention_module.LAUNCH)
        if self.variant.aliased:
            d.layers = [d.layers[0]] * len(d.layers)
            d.fused = [d.fused[0]] * len(d.fused)
        if self.variant.prefetch:
            d.decode = _decode_with_prefetch(d, self.variant.prefetch, self.variant.policy)
        attention_module.LAUNCH = dataclasses.replace(
            attention_module.LAUNCH, kv_eviction=self.variant.kv_eviction
        )
        self.engine.graphs.clear()
        return self

    def __exit__(self, *exc):
        d = self.engine.decoder
        d.layers, d.fused, decode, attention_module.LAUNCH = self.saved
        if decode is None:
            d.__dict__.pop("decode", None)
        else:
            d.decode = decode
        self.engine.graphs.clear()


def step(engine, batch: int, rounds: int = 2) -> dict:
    call = Call(engine, batch, 256, 256)
    call.admit()
    call.steps(8)
    bs, width = call.step_shape()
    tokens = call.state.last_tokens[:bs].clone()
    positions = call.state.positions[:bs].clone()
    kv = call.kv

    def logits_of():
        out = engine.graphs.run(tokens, positions, kv, width)
        return out.float().clone()

    steps = 32

    def replays():
        for _ in range(steps):
            engine.graphs.run(tokens, positions, kv, width)

    with Applied(engine, VARIANTS["default"]):
        reference = logits_of()
    out: dict = {"rows": bs, "width": width, "checks": {}, "step_us": {}}
    for r in range(rounds):
        for name, variant in VARIANTS.items():
            with Applied(engine, variant):
                got = logits_of()
                if not variant.aliased and r == 0:  # aliased: other weights, other logits
                    out["checks"][name] = (got - reference).abs().max().item()
                us = _cuda_ms(replays, 5) * 1e3 / steps
            out["step_us"].setdefault(name, []).append(us)
    return out


def e2e(engine, variant_name: str, batch: int = 256, rounds: int = 3) -> dict:
    pairs = []
    for _ in range(rounds):
        with Applied(engine, VARIANTS["default"]):
            base = ge.engine_speed(engine, batch, 256, 256, False)["tok_s"]
        with Applied(engine, VARIANTS[variant_name]):
            new = ge.engine_speed(engine, batch, 256, 256, False)["tok_s"]
        pairs.append({"default": base, variant_name: new, "ratio": new / base})
    return {"pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    parser.add_argument("--sections", default="chain,step,e2e")
    parser.add_argument("--e2e-variant", default="")
    args = parser.parse_args()
    path = Path(args.out) / "gpu_l2_prefetch.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def run(name, fn) -> None:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections' figures
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[f"{name}_wall_s"] = time.perf_counter() - start
        print(name, json.dumps(results[name])[:3000], flush=True)
        path.write_text(json.dumps(results, indent=1))

    sections = args.sections.split(",")
    if "chain" in sections:
        run("chain_256", lambda: chain(256))
        run("chain_64", lambda: chain(64))
    engine = ge.qwen05_engine(args.workdir)
    if "step" in sections:
        run("step_256", lambda: step(engine, 256))
        run("step_64", lambda: step(engine, 64))
    if "e2e" in sections:
        name = args.e2e_variant
        if not name:  # the fastest prefetch variant of the 256-row step
            times = results.get("step_256", {}).get("step_us", {})
            candidates = {k: min(v) for k, v in times.items() if VARIANTS[k].prefetch}
            name = min(candidates, key=candidates.get) if candidates else "attention_evict_last"
        run("e2e_256", lambda: e2e(engine, name))


if __name__ == "__main__":
    main()
