"""Row groups on parallel streams again, with GEMMs that leave room on an SM.

The seventh session cut the decode step into row groups on parallel CUDA streams and lost
(0.95x): a second stream's kernels found no idle SMs. Nsight Compute (twenty-third
session) shows why: every cuBLAS projection runs one program an SM holding 165 to 232 KB
of shared memory, so nothing else can run beside it. The Triton GEMMs of
``kernels/matmul.py`` hold 48 KB (64 x 64 x 64 tiles, 3 stages): two groups' kernels can
share SMs. This times the decode step's graph at 256 rows with:

- the whole batch, cuBLAS (the default) or the Triton GEMMs;
- two or four row groups, one stream each, cuBLAS or Triton.

Each variant's logits are checked against the default's first (bf16: other kernels round
differently; the max absolute difference and the argmax agreement are reported).

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.gpu_row_groups --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import gpu_engine as ge
from benchmarks.gpu_engine_breakdown import Call, _cuda_ms


def _split_decode(decoder, parts: int):
    """``StaticDecoder.decode`` over ``parts`` row groups, one stream each; each group
    writes its rows of one logits buffer."""
    streams = [torch.cuda.Stream() for _ in range(parts - 1)]
    weight = decoder.lm_head.weight

    def run(tokens, positions, k_cache, v_cache, width, logits):
        bs = tokens.shape[0]
        ops = decoder.ops
        cos_t, sin_t = decoder.rope_table(width)
        x = decoder.embed(tokens)
        h = ops.rms_norm(x, decoder.layers[0].input_layernorm.weight, decoder.eps)
        attend = decoder._triton_attention(positions, k_cache, v_cache, cos_t, sin_t, width)
        for i, layer in enumerate(decoder.layers):
            q, k, v = decoder._qkv(i, h, (bs,))
            o = attend(i, q, k, v)
            o_proj = layer.self_attn.o_proj
            o = decoder._linear(o.reshape(bs, -1), o_proj.weight, o_proj.bias)
            x, h = ops.add_rms_norm(x, o, layer.post_attention_layernorm.weight, decoder.eps)
            x, h = ops.add_rms_norm(
                x, decoder._mlp(i, h), decoder._next_norm_weight(i), decoder.eps
            )
        torch.mm(h, weight.t(), out=logits)

    @torch.inference_mode()
    def decode(tokens, positions, k_cache, v_cache, width):
        bs = tokens.shape[0]
        logits = torch.empty(bs, weight.shape[0], dtype=weight.dtype, device=tokens.device)
        size = -(-bs // parts)
        groups = [(lo, min(lo + size, bs)) for lo in range(0, bs, size)]
        main = torch.cuda.current_stream()

        def group(lo, hi):
            run(
                tokens[lo:hi],
                positions[lo:hi],
                k_cache[:, lo:hi],
                v_cache[:, lo:hi],
                width,
                logits[lo:hi],
            )

        for stream, (lo, hi) in zip(streams, groups[1:], strict=False):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                group(lo, hi)
        group(*groups[0])
        for stream in streams[: len(groups) - 1]:
            main.wait_stream(stream)
        return logits

    return decode


VARIANTS = {  # name: (Triton GEMMs, row groups)
    "cublas_whole": (False, 1),
    "triton_whole": (True, 1),
    "cublas_2_groups": (False, 2),
    "triton_2_groups": (True, 2),
    "triton_4_groups": (True, 4),
}


class Applied:
    def __init__(self, engine, name: str):
        self.engine = engine
        self.triton, self.parts = VARIANTS[name]

    def __enter__(self):
        d = self.engine.decoder
        self.saved = (d.linear_kernels, d.__dict__.get("decode"))
        d.linear_kernels = self.triton
        if self.parts > 1:
            d.decode = _split_decode(d, self.parts)
        self.engine.graphs.clear()
        return self

    def __exit__(self, *exc):
        d = self.engine.decoder
        d.linear_kernels, decode = self.saved
        if decode is None:
            d.__dict__.pop("decode", None)
        else:
            d.decode = decode
        self.engine.graphs.clear()


def step(engine, batch: int = 256, rounds: int = 2) -> dict:
    call = Call(engine, batch, 256, 256)
    call.admit()
    call.steps(8)
    bs, width = call.step_shape()
    tokens = call.state.last_tokens[:bs].clone()
    positions = call.state.positions[:bs].clone()
    kv = call.kv
    steps = 32

    def replays():
        for _ in range(steps):
            engine.graphs.run(tokens, positions, kv, width)

    with Applied(engine, "cublas_whole"):
        reference = engine.graphs.run(tokens, positions, kv, width).float().clone()
    out: dict = {"rows": bs, "width": width, "checks": {}, "step_us": {}}
    for r in range(rounds):
        for name in VARIANTS:
            with Applied(engine, name):
                got = engine.graphs.run(tokens, positions, kv, width).float()
                if r == 0:
                    out["checks"][name] = {
                        "max_abs_logit_diff": (got - reference).abs().max().item(),
                        "argmax_agreement": (got.argmax(-1) == reference.argmax(-1))
                        .float()
                        .mean()
                        .item(),
                    }
                us = _cuda_ms(replays, 5) * 1e3 / steps
            out["step_us"].setdefault(name, []).append(us)
    return out


def e2e(engine, name: str, batch: int = 256, rounds: int = 3) -> dict:
    pairs = []
    for _ in range(rounds):
        with Applied(engine, "cublas_whole"):
            base = ge.engine_speed(engine, batch, 256, 256, False)["tok_s"]
        with Applied(engine, name):
            new = ge.engine_speed(engine, batch, 256, 256, False)["tok_s"]
        pairs.append({"default": base, name: new, "ratio": new / base})
    return {"pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    args = parser.parse_args()
    path = Path(args.out) / "gpu_row_groups.json"
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

    engine = ge.qwen05_engine(args.workdir)
    run("step_256", lambda: step(engine))
    times = results.get("step_256", {}).get("step_us", {})
    best = min((n for n in times if n != "cublas_whole"), key=lambda n: min(times[n]), default=None)
    if best is not None:
        run("e2e_256", lambda: e2e(engine, best))


if __name__ == "__main__":
    main()
