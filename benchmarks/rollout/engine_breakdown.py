"""Where a generate call's time goes on the GPU: the prefill, the decode step's graph, the
work each step does outside it, and the rest, each timed alone with CUDA events; kernel
time by kind (GEMM, attention, norms, ...) for the prefill and for decode steps.

    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.rollout.engine_breakdown --out $OUT

Batch 256, 256 prompt + 256 new tokens, T = 1, as the engine rows of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.rollout import engine as ge
from services.rollout.fast.engine import _SLOT_ALIGN, FastEngine
from services.rollout.fast.scheduler import Scheduler
from services.rollout.fast.slots import SlotState
from services.rollout.types import SamplingParams

KINDS = (
    # (kind, any of these in the kernel's name), first match wins
    ("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce", "_matmul_kernel", "_split_k")),
    ("attention", ("flash", "_decode_attention", "_combine_splits", "fmha")),
    ("rope_store", ("_rope_store",)),
    ("silu", ("silu",)),
    ("sampling", ("_cdf_", "gumbel", "_sample")),
    ("norm_add (compiled)", ("rsqrt",)),
    ("other compiled", ("triton_",)),
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def _cuda_ms(fn, repeats: int) -> float:
    """Median ms of ``fn`` between CUDA events, one run after another."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(fn) -> tuple[dict, dict, int]:
    """Kernel µs of one ``fn`` run by kind and by name (top 15), and the launch count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: Counter = Counter()
    by_name: Counter = Counter()
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            by_kind[kind_of(e.name)] += e.device_time_total
            by_name[e.name[:80]] += e.device_time_total
            launches += 1
    return dict(by_kind), dict(by_name.most_common(15)), launches


class Call:
    """A generate call's set-up (slots, scheduler, sampling) as ``FastEngine.generate``
    makes it, so that its phases can be run and timed one by one."""

    def __init__(self, engine: FastEngine, batch: int, prompt_len: int, new: int):
        self.engine = engine
        self.params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new, seed=1)
        self.prompts = ge.random_prompts(
            100 + batch, batch, prompt_len, prompt_len, engine.vocab_size
        )
        self.sampling = engine._sampling(self.params)
        slot_len = -(-(prompt_len + new) // _SLOT_ALIGN) * _SLOT_ALIGN
        self.kv = engine.cache.view(slot_len, batch)
        self.reset()

    def reset(self) -> None:
        e = self.engine
        self.state = SlotState(
            self.kv.slots, self.params.max_tokens, self.kv.slot_len, e.runner.device
        )
        lengths = self.prompts.lengths.tolist()
        self.sched = Scheduler(lengths, 1, self.kv.slots, self.params.max_tokens)
        self.admitted = self.sched.admit()

    def admit(self) -> None:
        self.engine._admit(self.prompts, self.admitted, self.kv, self.state, self.sampling)

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.engine._decode_step(self.kv, self.state, self.sched, self.sampling)

    def step_shape(self) -> tuple[int, int]:
        """(rows, attended width) of the next decode step, as ``_decode_step`` picks them."""
        from services.rollout.fast.cuda_graphs import row_bucket, width_bucket
        from services.rollout.fast.engine import _WIDTH_STEP

        s = self.sched
        bs = row_bucket(s.rows_needed(), min(self.kv.k.shape[1], self.engine.max_num_seqs))
        return bs, width_bucket(s.width_needed(), _WIDTH_STEP, self.kv.slot_len)

    def graph_steps(self, count: int) -> None:
        """The decode graph alone, at the scheduler's current rows and width."""
        bs, width = self.step_shape()
        for _ in range(count):
            self.engine.graphs.run(
                self.state.last_tokens[:bs], self.state.positions[:bs], self.kv, width
            )


def breakdown(engine: FastEngine, batch: int = 256, prompt_len: int = 256, new: int = 256) -> dict:
    out: dict = {}
    out["generate"] = ge.engine_speed(engine, batch, prompt_len, new, False)
    call = Call(engine, batch, prompt_len, new)
    call.admit()  # warm-up
    out["prefill_ms"] = _cuda_ms(call.admit, 5)
    tokens = batch * prompt_len
    flops = tokens * _flops_per_prompt_token(engine, prompt_len)
    out["prefill_tflops"] = flops / (out["prefill_ms"] / 1e3) / 1e12
    kinds, names, launches = _kernels(call.admit)
    out["prefill_kernel_us"] = {"by_kind": kinds, "top": names, "launches": launches}

    call.reset()
    call.admit()
    call.steps(8)  # captures the first width's graph
    steps = 64
    out["step_ms_with_sampling"] = _cuda_ms(lambda: call.steps(steps), 1) / steps
    out["step_ms_graph_only"] = _cuda_ms(lambda: call.graph_steps(steps), 3) / steps
    kinds, names, launches = _kernels(lambda: call.steps(16))
    out["step_kernel_us"] = {
        "by_kind": {k: v / 16 for k, v in kinds.items()},
        "top": {k: v / 16 for k, v in names.items()},
        "launches_per_step": launches / 16,
    }
    total_s = out["generate"]["seconds"]
    decode_s = new * out["step_ms_with_sampling"] / 1e3
    out["shares"] = {
        "generate_s": total_s,
        "prefill_s": out["prefill_ms"] / 1e3,
        "decode_s_estimate": decode_s,
        "rest_s": total_s - out["prefill_ms"] / 1e3 - decode_s,
    }
    return out


def generate_timeline(
    engine: FastEngine, batch: int = 256, prompt_len: int = 256, new: int = 256
) -> dict:
    """One generate call with the host clock and a CUDA event at each of the engine's named
    ranges (``host_timeline``), per step ranges left out: where the host and the GPU were
    (ms from the call's start) at setup, each prefill plan, the first tokens, each decode
    round and check, and the finish. A point the GPU reached right after the host did
    (lag near 0) found the GPU waiting for the host."""
    from benchmarks.system.host_timeline import Timeline, timed_ranges, wait_for_quiet_children
    from services.rollout.fast import engine as fast_engine

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new, seed=1)
    prompts = ge.random_prompts(100 + batch, batch, prompt_len, prompt_len, engine.vocab_size)
    engine.generate(prompts, params)
    wait_for_quiet_children()
    timeline = Timeline()
    with timed_ranges(timeline, [fast_engine]):
        timeline.mark("generate >")
        engine.generate(prompts, params)
        timeline.mark("generate <")
    rows = [
        r
        for r in timeline.report()
        if not r["point"].startswith(("meshrl/sample", "meshrl/record"))
    ]
    inside: Counter = Counter()
    opened: dict[str, float] = {}
    for r in rows:
        name, edge = r["point"].rsplit(" ", 1)
        if edge == ">":
            opened[name] = r["host_ms"]
        elif name in opened:
            inside[name] += r["host_ms"] - opened.pop(name)
    return {"host_ms_inside": dict(inside), "rows": rows}


def blas_ab(engine: FastEngine, batch: int = 256, rounds: int = 3) -> dict:
    """The decode step's graph under each of torch's BLAS back ends for its GEMMs (cuBLAS,
    cuBLASLt: different kernel heuristics), interleaved; logits against the default's."""
    default = torch.backends.cuda.preferred_blas_library()
    libraries = ("cublas", "cublaslt")
    call = Call(engine, batch, 256, 256)
    call.admit()
    call.steps(8)
    bs, width = call.step_shape()
    tokens, positions = call.state.last_tokens[:bs].clone(), call.state.positions[:bs].clone()
    out: dict = {"default": str(default)}
    times: dict[str, list[float]] = {lib: [] for lib in libraries}
    prefill: dict[str, list[float]] = {lib: [] for lib in libraries}
    logits = {}
    try:
        for lib in libraries:  # first, on the same cache: the timing below rewrites it
            torch.backends.cuda.preferred_blas_library(lib)
            engine.graphs.clear()
            logits[lib] = engine.graphs.run(tokens, positions, call.kv, width).float()
        for _ in range(rounds):
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                engine.graphs.clear()
                call.graph_steps(10)
                times[lib].append(_cuda_ms(lambda: call.graph_steps(200), 1) / 200)
                call.admit()  # its own warm-up (cuBLAS picks per back end)
                prefill[lib].append(_cuda_ms(call.admit, 1))
        for rep in range(2):
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                engine.graphs.clear()
                out[f"generate_{lib}_{rep}"] = ge.engine_speed(engine, batch, 256, 256, False)[
                    "tok_s"
                ]
    finally:
        torch.backends.cuda.preferred_blas_library(default)
        engine.graphs.clear()
    out["step_ms"] = {lib: statistics.median(v) for lib, v in times.items()}
    out["step_ms_all"] = times
    out["prefill_ms"] = {lib: statistics.median(v) for lib, v in prefill.items()}
    out["max_abs_logit_diff"] = (logits["cublaslt"] - logits["cublas"]).abs().max().item()
    out["argmax_agree"] = (
        (logits["cublaslt"].argmax(-1) == logits["cublas"].argmax(-1)).float().mean().item()
    )
    return out


def _flops_per_prompt_token(engine: FastEngine, prompt_len: int) -> float:
    """2 x the layers' weights, plus causal attention's two products at mean context
    prompt_len / 2 (the LM head runs on last tokens only: left out)."""
    cfg = engine.runner.model.config
    layers = sum(
        p.numel()
        for n, p in engine.runner.model.named_parameters()
        if ".layers." in n and p.dim() == 2
    )
    attention = (
        4
        * cfg.num_hidden_layers
        * cfg.num_attention_heads
        * (cfg.hidden_size // cfg.num_attention_heads)
        * prompt_len
        / 2
    )
    return 2 * layers + attention


def variants(engine: FastEngine, batch: int = 256, chunks_only: bool = False) -> dict:
    """Whole generate calls under a few engine settings, interleaved twice. ``chunks_only``:
    prefill chunk sizes alone (``max_prefill_tokens``; on the H200, chunks of 2,048 and
    4,096 tokens lost to the default 16,384: the eager prefill became host-bound)."""
    settings = (
        ("default", {}),
        ("prefill_2048", {"max_prefill_tokens": 2048}),
        ("prefill_4096", {"max_prefill_tokens": 4096}),
        ("prefill_65536", {"max_prefill_tokens": 65536}),
    )
    if not chunks_only:
        settings += (("check_every_16", {"check_every": 16}),)
    base = {k: getattr(engine, k) for _, s in settings for k in s}
    out = {}
    for rep in range(2):
        for name, changes in settings:
            for k, v in {**base, **changes}.items():
                setattr(engine, k, v)
            out[f"{name}_{rep}"] = ge.engine_speed(engine, batch, 256, 256, False)["tok_s"]
    for k, v in base.items():
        setattr(engine, k, v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/meshrl_gpu")
    parser.add_argument("--sections", default="timeline,breakdown,variants")
    args = parser.parse_args()
    path = Path(args.out) / "rollout_engine_breakdown.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def run(name, fn) -> None:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections' figures
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[f"{name}_wall_s"] = time.perf_counter() - start
        print(name, json.dumps(results[name])[:1500], flush=True)
        path.write_text(json.dumps(results, indent=1))

    engine = ge.qwen05_engine(args.workdir)
    sections = args.sections.split(",")
    if "timeline" in sections:
        run("timeline_b256", lambda: generate_timeline(engine))
    if "breakdown" in sections:
        run("breakdown_b256", lambda: breakdown(engine))
    if "blas" in sections:
        run("blas_b256", lambda: blas_ab(engine))
    if "variants" in sections:
        run("variants_b256", lambda: variants(engine))


if __name__ == "__main__":
    main()
