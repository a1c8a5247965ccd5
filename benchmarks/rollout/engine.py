"""Native engine on the GPU: fast path checked against the plain path, then timed against
Hugging Face ``generate`` (eager and static cache) on the same model, batch and lengths.

Called by ``gpu_suite.py``; each function returns a dict of JSON-able figures.
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import torch

from benchmarks.gpu_models import make_model_dir
from benchmarks.system.host_timeline import wait_for_quiet_children
from meshrl.ragged import Ragged
from services.rollout.fast import kernels
from services.rollout.fast.engine import FastEngine
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams


def qwen05_engine(workdir: str) -> FastEngine:
    """The engine every GPU benchmark times: the random Qwen2.5-0.5B-shaped model in bf16,
    256 slots, 30% of the GPU for its cache, sequences up to 1,024 tokens."""
    return FastEngine(
        make_model_dir(f"{workdir}/qwen05_bf16"),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=256,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
    )


def random_prompts(seed: int, count: int, low: int, high: int, vocab: int) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return Ragged.from_lists(
        [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    )


def _prefix_agreement(a: Ragged, b: Ragged) -> tuple[float, float]:
    """(fraction of rows identical, mean fraction of tokens before the first difference)."""
    same, prefix = 0, []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        same += x == y
        k = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        prefix.append(k / max(1, len(x)))
    return same / len(a), statistics.mean(prefix)


def check_fp32(workdir: str) -> dict:
    """float32, 4 layers of the 0.5B shape: graphs, eager fast path and Hugging Face must
    give the same greedy tokens (16 slots for 40 sequences: refills and compaction)."""
    path = make_model_dir(f"{workdir}/qwen05_l4_fp32", layers=4, dtype=torch.float32)
    fast = FastEngine(
        path,
        dtype="float32",
        device="cuda",
        max_num_seqs=16,
        gpu_memory_utilization=0.2,
        max_model_len=512,
    )
    prompts = random_prompts(11, 20, 4, 200, 151936)
    params = SamplingParams(temperature=0, max_tokens=48, n=2)
    graphs = fast.generate(prompts, params)
    fast.graphs.enabled = False
    eager = fast.generate(prompts, params)
    fast.graphs.enabled = True
    plain = NativeEngine.generate(fast, prompts, params)  # the Hugging Face forward
    rows_same, prefix = _prefix_agreement(graphs.responses, plain.responses)
    out = {
        "graphs_equal_eager_fast": graphs.responses.tolist() == eager.responses.tolist(),
        "graphs_vs_hf_rows_identical": rows_same,
        "graphs_vs_hf_mean_prefix": prefix,
        "graphs_vs_hf_logprob_max_abs": _lp_diff(graphs, plain, rows_same == 1.0),
        "graphs_captured": fast.graphs.num_graphs,
    }
    del fast
    torch.cuda.empty_cache()
    return out


def check_packed_attention() -> dict:
    """The prefill's packed attention, bf16, 14 query heads over 2 kv heads, three sequences:
    the forward op with grouped heads as they are, against varlen_attn's path (keys
    repeated where the torch release needs it) and a float32 SDPA per sequence."""
    from meshrl import packed_attention as pa

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [300, 1, 700]
    cu = torch.tensor([0, 300, 301, 1001], dtype=torch.int32, device="cuda")
    q = torch.randn(1001, 14, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(1001, 2, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(1001, 2, 64, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        native = pa._flash_forward(q, k, v, cu, max(lengths), 0.125)
        repeated = pa._flash_varlen(q, k, v, cu, cu, max(lengths), max(lengths), 0.125)
        exact = pa._per_sequence_sdpa(q.float(), k.float(), v.float(), cu, 0.125, True)
    return {
        "native_vs_varlen_max_abs": float((native.float() - repeated.float()).abs().max()),
        "native_vs_float32_max_abs": float((native.float() - exact).abs().max()),
        "varlen_vs_float32_max_abs": float((repeated.float() - exact).abs().max()),
    }


def _lp_diff(a, b, comparable: bool) -> float | None:
    if not comparable:
        return None
    return float((a.logprobs.values - b.logprobs.values).abs().max())


def check_bf16(engine: FastEngine) -> dict:
    """bfloat16, full model: graphs vs eager fast path (same kernels: identical tokens),
    vs Hugging Face greedy (bf16 rounding may flip near-ties), and the engine's sampled
    log-probs against a full Hugging Face forward over the same tokens (what the trainer
    computes), plus release/resume."""
    prompts = random_prompts(21, 24, 8, 256, 151936)
    greedy = SamplingParams(temperature=0, max_tokens=64, n=2)
    graphs = engine.generate(prompts, greedy)
    engine.graphs.enabled = False
    eager = engine.generate(prompts, greedy)
    engine.graphs.enabled = True
    plain = NativeEngine.generate(engine, prompts, greedy)
    rows_same, prefix = _prefix_agreement(graphs.responses, plain.responses)
    attention = engine.decoder.attention
    engine.decoder.attention = "matmul"  # the torch attention path, same graphs otherwise
    engine.graphs.clear()
    torch_path = engine.generate(prompts, greedy)
    engine.decoder.attention = attention
    engine.graphs.clear()
    paths_same, paths_prefix = _prefix_agreement(graphs.responses, torch_path.responses)
    rope_in_attention = engine.decoder.rope_in_attention
    engine.decoder.rope_in_attention = not rope_in_attention  # one launch a layer, or two
    engine.graphs.clear()
    other = engine.generate(prompts, greedy)
    engine.decoder.rope_in_attention = rope_in_attention
    engine.graphs.clear()
    rope_same, rope_prefix = _prefix_agreement(graphs.responses, other.responses)
    engine.decoder.pack_prompts = False  # right-padded prompts through SDPA
    padded = engine.generate(prompts, greedy)
    engine.decoder.pack_prompts = True
    padded_same, padded_prefix = _prefix_agreement(graphs.responses, padded.responses)
    first = torch.tensor([r[0] for r in graphs.responses.tolist()])
    first_padded = torch.tensor([r[0] for r in padded.responses.tolist()])
    sampled_params = SamplingParams(temperature=1.0, max_tokens=128, n=2, seed=5)
    sampled = engine.generate(prompts, sampled_params)
    repeated = prompts.select([i for i in range(len(prompts)) for _ in range(2)])
    scored = engine.score(repeated, sampled.responses, 1.0, with_entropy=False)
    diff = (scored.logprobs.values - sampled.logprobs.values).abs()
    before = torch.cuda.memory_allocated()
    engine.release_memory()
    released = torch.cuda.memory_allocated()
    engine.resume_memory()
    again = engine.generate(prompts, greedy)
    return {
        "graphs_equal_eager_fast": graphs.responses.tolist() == eager.responses.tolist(),
        "attention": attention,
        "vs_torch_attention_rows_identical": paths_same,
        "vs_torch_attention_mean_prefix": paths_prefix,
        "rope_in_attention": rope_in_attention,
        "rope_inside_vs_own_kernel_rows_identical": rope_same,
        "rope_inside_vs_own_kernel_mean_prefix": rope_prefix,
        "packed_vs_padded_prefill_rows_identical": padded_same,
        "packed_vs_padded_prefill_mean_prefix": padded_prefix,
        "packed_vs_padded_prefill_first_tokens_equal": float(
            (first == first_padded).float().mean()
        ),
        "graphs_vs_hf_greedy_rows_identical": rows_same,
        "graphs_vs_hf_greedy_mean_prefix": prefix,
        "engine_vs_hf_forward_logprob_mean_abs": float(diff.mean()),
        "engine_vs_hf_forward_logprob_max_abs": float(diff.max()),
        "release_freed_gib": (before - released) / 2**30,
        "kv_cache_gib": engine.kv_cache_bytes / 2**30,
        "same_tokens_after_resume": again.responses.tolist() == graphs.responses.tolist(),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def engine_speed(engine: FastEngine, batch: int, prompt_len: int, new: int, eager: bool) -> dict:
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new, seed=1)
    prompts = random_prompts(100 + batch, batch, prompt_len, prompt_len, engine.vocab_size)
    engine.graphs.enabled = not eager
    _sync()
    start = time.perf_counter()
    engine.generate(prompts, params)  # warm-up: captures this shape's graphs
    _sync()
    first = time.perf_counter() - start
    # torch.compile's worker processes start after the first compile and keep the cores
    # busy for seconds: a host-bound loop timed then is slowed by a start-up cost.
    quiet_s = wait_for_quiet_children()
    seconds, out = _timed(lambda: engine.generate(prompts, params), 1 if eager else 3)
    engine.graphs.enabled = True
    tokens = out.responses.values.numel()
    return {
        "seconds": seconds,
        "new_tokens": tokens,
        "tok_s": tokens / seconds,
        "first_call_s": first,
        "waited_for_quiet_host_s": quiet_s,
    }


def hf_speed(
    model, batch: int, prompt_len: int, new: int, static: bool, attention: str | None = None
) -> dict:
    """transformers ``generate`` with the same sampling (T=1, no top-k/top-p).

    ``attention``: the model's ``attn_implementation`` for this call only ("eager": Hugging
    Face's own matmul + softmax attention; None: as loaded, SDPA by default)."""
    g = torch.Generator().manual_seed(200 + batch)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=g).to(model.device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new,
        pad_token_id=0,
    )
    if static:
        kwargs["cache_implementation"] = "static"
    loaded = model.config._attn_implementation
    if attention is not None:
        model.set_attn_implementation(attention)
    try:
        _sync()
        start = time.perf_counter()
        with torch.inference_mode():  # first call: warm-up (for static: compilation)
            model.generate(ids, **kwargs)
        _sync()
        first = time.perf_counter() - start
        quiet_s = wait_for_quiet_children()  # as for the engine (engine_speed)
        with torch.inference_mode():
            seconds, out = _timed(lambda: model.generate(ids, **kwargs), 1)
    finally:
        model.set_attn_implementation(loaded)
    tokens = (out.shape[1] - prompt_len) * batch
    return {
        "seconds": seconds,
        "new_tokens": tokens,
        "tok_s": tokens / seconds,
        "first_call_s": first,
        "waited_for_quiet_host_s": quiet_s,
        "attn_implementation": attention or loaded,
    }


def pair_ratios(pairs: list[dict]) -> dict:
    """Each pair's engine / eager ratio, and the median, least and greatest of them (pairs
    of ``tok_s`` figures under the keys "engine" and "eager")."""
    pairs = [{**p, "ratio": p["engine"] / p["eager"]} for p in pairs]
    ratios = [p["ratio"] for p in pairs]
    return {
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }


def side_by_side(
    engine: FastEngine, batch: int, pairs: int = 3, prompt_len: int = 256, new: int = 256
) -> dict:
    """The engine and eager ``generate`` (same prompt and new lengths, same sampling) timed
    in turn, ``pairs`` times. Eager ``generate`` is bound by the host's Python, whose speed
    moves within a call as well as between calls; timing the two in turn gives each ratio
    the same host, and the spread of the ratios shows how much the host moved."""
    model = engine.runner.model
    timed = []
    for _ in range(pairs):
        fast = engine_speed(engine, batch, prompt_len, new, False)
        eager = hf_speed(model, batch, prompt_len, new, False)
        timed.append(
            {
                "engine": fast["tok_s"],
                "eager": eager["tok_s"],
                # untimed warm-ups: the engine's captures graphs on a new shape
                "engine_first_call_s": fast["first_call_s"],
                "eager_first_call_s": eager["first_call_s"],
            }
        )
    return pair_ratios(timed)


def bandwidth_floor_tok_s(
    engine: FastEngine, batch: int, prompt_len: int, new: int, copy_gbs: float
) -> float:
    """New tokens/s if every decode step only read the weights once and each sequence's
    keys/values once, at the measured copy bandwidth (GB/s, read + write counted)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    per_token = engine.decoder.kv_shape.bytes_per_token
    total_bytes = 0
    for step in range(new):
        total_bytes += weight_bytes + batch * (prompt_len + step) * per_token
    return batch * new / (total_bytes / (copy_gbs * 1e9))


BASE_SETTINGS = dict(
    compiled=True,  # element-wise ops compiled
    attention="triton",  # decode attention: "triton", "matmul" (batched matmul)
    sampling="inverse_cdf",  # "inverse_cdf": one uniform a row; "gumbel": Gumbel-max split
    # over programs; "one_program": Gumbel-max, a program a row; "torch": Exp(1) race in torch
    pack=True,  # prompts prefilled packed
    rope=True,  # rope and the cache write inside the attention kernel (else a kernel before)
    gemm=None,  # None: cuBLAS; "default": Triton GEMMs, default configs; "tuned": tuned ones
)
DECODE_VARIANTS = (
    ("default", {}),
    ("rope_own_kernel", dict(rope=False)),
    ("triton_gemm_tuned", dict(gemm="tuned")),
    ("rope_own_kernel_triton_gemm_tuned", dict(rope=False, gemm="tuned")),
    ("triton_gemm_default", dict(gemm="default")),
    ("padded_prefill", dict(pack=False)),
    ("gumbel_sampling", dict(sampling="gumbel")),
    ("sampling_one_program", dict(sampling="one_program")),
    ("torch_sampling", dict(sampling="torch")),
    ("default_again", {}),
    ("rope_own_kernel_again", dict(rope=False)),
    ("triton_gemm_tuned_again", dict(gemm="tuned")),
    ("rope_own_kernel_triton_gemm_tuned_again", dict(rope=False, gemm="tuned")),
    ("matmul_attention", dict(attention="matmul")),
)


def configure(engine: FastEngine, settings: dict, tuned: dict | None = None) -> None:
    """Puts the engine in one of the variants' settings (``BASE_SETTINGS`` keys); ``tuned``:
    the decoder's ``matmul_configs`` for gemm="tuned"."""
    from services.rollout.fast import gpu_sampler

    s = {**BASE_SETTINGS, **settings}
    engine.decoder.use_compiled_ops(s["compiled"])
    engine.decoder.attention = s["attention"]
    engine.decoder.rope_in_attention = s["rope"]
    engine.decoder.pack_prompts = s["pack"]
    engine.decoder.linear_kernels = s["gemm"] is not None
    engine.decoder.matmul_configs = dict(tuned or {}) if s["gemm"] == "tuned" else {}
    gpu_sampler._compiled.pop("no_kernel", None)
    kernels.sample_gumbel = _SAMPLE_GUMBEL
    gpu_sampler.SAMPLING_KERNEL = "inverse_cdf" if s["sampling"] == "inverse_cdf" else "gumbel"
    # (one_program and torch go through the Gumbel kernel's switches below)
    if s["sampling"] == "torch":
        gpu_sampler._compiled["no_kernel"] = True
    elif s["sampling"] == "one_program":
        kernels.sample_gumbel = functools.partial(_SAMPLE_GUMBEL, splits=1)
    engine.graphs.clear()


_SAMPLE_GUMBEL = kernels.sample_gumbel  # the kernel itself, whatever a variant swapped in


def decode_variants(engine: FastEngine, batch: int = 256, tuned: dict | None = None) -> dict:
    """The same timed run under each of ``DECODE_VARIANTS``, one after another on the same
    engine (the "tuned" GEMM ones only with ``tuned`` configs); leaves the default set."""
    out = {}
    try:
        for name, settings in DECODE_VARIANTS:
            if settings.get("gemm") == "tuned" and not tuned:
                continue
            configure(engine, settings, tuned)
            try:
                out[name] = engine_speed(engine, batch, 256, 256, False)
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        configure(engine, {})
    return out


AB_SETTINGS = (
    # name: (read checks a round late, BASE_SETTINGS changes)
    ("default", True, {}),
    ("sync_checks", False, {}),
    ("gumbel", True, dict(sampling="gumbel")),
)


def ab_runs(engine: FastEngine, batch: int = 256, repeats: int = 2) -> dict:
    """The engine's read-late checks and inverse-CDF sampler against what they replaced,
    interleaved ``repeats`` times at ``batch`` rows: checks read a round late vs each read
    at once (a sync), and inverse-CDF sampling vs the Gumbel kernel. Leaves the defaults set."""
    out = {}
    try:
        for rep in range(repeats):
            for name, late, settings in AB_SETTINGS:
                configure(engine, settings)
                engine.read_late = late
                out[f"{name}_{rep}"] = engine_speed(engine, batch, 256, 256, False)
    finally:
        configure(engine, {})
        engine.read_late = True
    return out


def best_settings(variants: dict) -> tuple[str, dict]:
    """The variant (of those run twice) with the best mean of its two runs."""
    means = {}
    for name, _settings in DECODE_VARIANTS:
        again = variants.get(f"{name}_again", {})
        if "tok_s" in variants.get(name, {}) and "tok_s" in again:
            means[name] = (variants[name]["tok_s"] + again["tok_s"]) / 2
    best = max(means, key=means.get)
    return best, dict(DECODE_VARIANTS)[best]


def tuned_configs(tune: dict) -> dict:
    """The decoder's ``matmul_configs`` from ``benchmarks.rollout.matmul.tune``'s results: each
    shape's best config in a CUDA graph where it beat cuBLAS's graph, else "torch"."""
    from benchmarks.rollout.matmul import SHAPES
    from services.rollout.fast.kernels.matmul import MatmulConfig

    configs = {}
    for name, shape in SHAPES.items():
        kind = "gate_up" if shape["gate_up"] else "linear"
        for m, found in tune.get("shapes", {}).get(name, {}).items():
            best = found.get("best_graph")
            key = (kind, shape["n"], shape["k"], int(m))
            if best and best.get("graph_us", 1e9) < found.get("torch_graph_us", 0):
                configs[key] = MatmulConfig(**best["config"])
            else:
                configs[key] = "torch"
    return configs


def _us_per_call(call, calls: int) -> float:
    """Microseconds a call of ``call(i)``, i = 0..calls-1, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        call(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def sampling_kernel_us(rows: int = 256, vocab: int = 151936, calls: int = 50) -> dict:
    """The sampling kernel alone on random bf16 logits, microseconds a call (CUDA events):
    its vocabulary split automatically with blocks of 2048, 1024 and 512 columns, and one
    program a row (the earlier layout). All draw the same tokens (same noise,
    checked)."""
    from services.rollout.fast import kernels

    logits = torch.randn(rows, vocab, device="cuda").bfloat16()
    out = {}
    tokens = {}
    for name, splits, block in (
        ("auto_b2048", None, 2048),
        ("auto_b1024", None, 1024),
        ("auto_b512", None, 512),
        ("one_program_b2048", 1, 2048),
    ):
        run = functools.partial(kernels.sample_gumbel, splits=splits, block=block)
        tokens[name] = run(logits, 1.0, 7, 0)[0]
        out[f"{name}_us"] = _us_per_call(lambda i, run=run: run(logits, 1.0, 7, 4 * i), calls)
    out["same_tokens"] = all(torch.equal(t, tokens["auto_b2048"]) for t in tokens.values())
    # Inverse CDF: another random stream (its tokens are not the Gumbel kernel's); its
    # log-probs are checked against log_softmax at its tokens, and its draws against the
    # softmax's probabilities (the mean probability of the drawn tokens over many calls
    # against the expected sum of p^2 per row).
    cdf = kernels.sample_inverse_cdf
    t, lp = cdf(logits, 1.0, 7, 0)
    ref = torch.log_softmax(logits.float(), -1)
    out["cdf_logprob_max_abs"] = float((lp - ref.gather(1, t[:, None])[:, 0]).abs().max())
    out["inverse_cdf_us"] = _us_per_call(lambda i: cdf(logits, 1.0, 7, 4 * i), calls)
    probs = ref.exp()
    drawn_p = torch.stack(
        [probs.gather(1, cdf(logits, 1.0, 9, 4 * i)[0][:, None])[:, 0] for i in range(64)]
    )
    gumbel_p = torch.stack(
        [
            probs.gather(1, kernels.sample_gumbel(logits, 1.0, 9, 4 * i)[0][:, None])[:, 0]
            for i in range(64)
        ]
    )
    out["mean_p_of_drawn"] = {
        "inverse_cdf": float(drawn_p.mean()),
        "gumbel": float(gumbel_p.mean()),
        "expected_sum_p2": float((probs**2).sum(-1).mean()),
    }
    return out


def profile_decode(engine: FastEngine, out_dir, batch: int = 256, new: int = 64) -> dict:
    """One profiled generate (``batch`` x 256 prompt tokens, ``new`` new): its top ops to
    $OUT/profile.txt; returned, the GPU's busy and idle time with the idle split by the host's
    named range (``trace_gaps``: admit, decode, sample, record, collect) and the kernels'
    time per decode step by name (prefill kernels included: they run once)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.system.trace_gaps import gaps

    params = SamplingParams(temperature=1.0, max_tokens=new, seed=2)
    prompts = random_prompts(7, batch, 256, 256, engine.vocab_size)
    engine.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out_dir / "profile.txt").write_text(table)
    trace_path = out_dir / "engine_trace.json"
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    trace_path.unlink()  # tens of MB; the report is what comes back
    report = gaps(trace, top=8, min_us=20)
    kernel_us: Counter = Counter()
    launches = 0
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            kernel_us[e["name"][:70]] += e.get("dur", 0)
            launches += 1
    steps = new - 1  # the first token comes from the prefill
    return {
        **report,
        "decode_steps": steps,
        "kernels_per_step": launches / steps,
        "kernel_us_per_step": {k: round(v / steps, 2) for k, v in kernel_us.most_common(30)},
    }
