"""The fast engine, meshrl's vLLM engine and bare vLLM side by side on one GPU, same model
folder, lengths and sampling; vLLM's weight intake checked first.

    python3 -m benchmarks.rollout.engines_side_by_side --shapes 0.5b,7b --out $OUT
    python3 -m benchmarks.rollout.engines_side_by_side --engines native,vllm,vllm_bare \
        --shapes tiny --device cpu --batches 4 --runs 1 --check-shape none \
        --new-tokens 8 --prompt-len 8 --out /tmp/x                            # a dry run

Engines: ``native`` (the fast engine on a GPU, the native one on the CPU), ``vllm``
(meshrl's vLLM engine, ``services/rollout/vllm/``) and ``vllm_bare``: ``vllm.LLM.generate``
with no meshrl code in the timed calls, built with the arguments meshrl's engine passes
(read from its mapping, so they cannot drift apart) and given the same requests: token-id
prompts, temperature 1, the sampled token's log-prob (``logprobs=0``) and a seed per prompt,
or whatever ``--samplings`` names. Its raw file records the vLLM version, the ``vllm.LLM``
arguments and every ``SamplingParams`` setting.

``--samplings`` times each engine under several sampling settings in the same process
(``seeded_logprobs``, the training default of the native engines; ``logprobs``; ``seeded``;
``plain``: neither log-probs nor seeds, the vLLM defaults of a PPO step that uses neither;
docs/rollout.md, "vLLM: settings and speed").

Each engine runs in a process of its own (``--worker``), one after the other, so neither
holds GPU memory or compiled state while the other is timed. Per shape and engine:
start-up seconds; new tokens/s at each batch (``--runs`` timed calls after a warm-up, 256
random prompt tokens and 256 new tokens by default, temperature 1, no EOS in the model so
every response runs to its length). On the first shape, before timing, the correctness
checks (GPU only; ``--check-shape none`` skips them):

- greedy tokens of 64 prompts on the folder's weights, then on perturbed weights (every
  matrix plus noise of its own scale, seeded, so both processes make the same ones): the
  fast engine loads them with ``load_weights``; vLLM receives them through its intake,
  from a sender in this process over CUDA IPC, as the actor sends them, while asleep
  (sleep level 1: the intake wakes the weights alone). After the sync vLLM's greedy tokens
  must equal the fast engine's on the same weights, and differ from its own before it;
- the served weights' sums in vLLM's worker against the sender's;
- GPU memory in use (the whole device) around vLLM's sleep, the weights' wake and the
  KV cache's wake.

Writes ``$OUT/rollout_engines_side_by_side.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

SHAPES = ("tiny", "0.5b", "7b")
SAMPLINGS = {  # name: (seed of the request, log-probs asked for)
    "seeded_logprobs": (1, True),
    "logprobs": (None, True),
    "seeded": (1, False),
    "plain": (None, False),
}
CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_NEW = 64, 32, 32
# Names that vLLM's Qwen2 keeps as they are (its q/k/v and gate/up are fused): their sums
# in vLLM's worker must equal the sender's after a sync.
CHECKSUM_NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
)


def shape_config(shape: str):
    """Qwen2.5-0.5B's or Qwen2.5-7B's shape (or a 2-layer toy), with no EOS."""
    from transformers import Qwen2Config

    from benchmarks.gpu_models import qwen05_config

    if shape == "0.5b":
        return qwen05_config()
    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6)
    if shape == "7b":
        return Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
            **common,
        )  # fmt: skip
    return Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=True, **common,
    )  # fmt: skip


def make_folder(shape: str, root: Path, device: str) -> str:
    """Random bf16 weights of the shape. The output embedding is scaled up so that logits
    spread over several units: greedy choices then have margins far above bf16 rounding,
    and two engines on the same weights must agree token for token."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    path = root / f"qwen2_{shape}"
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(shape_config(shape)).to(torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
    model.generation_config = GenerationConfig(pad_token_id=0)
    model.save_pretrained(str(path))
    return str(path)


def perturbed_weights(model_path: str, device: str) -> dict[str, torch.Tensor]:
    """Every 2-D weight plus seeded noise of its own standard deviation (Hugging Face names,
    bf16). The same folder gives the same tensors in any process."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name in sorted(weights):
        w = weights[name].float()
        if w.dim() == 2:
            w = w + w.std() * torch.randn(w.shape, generator=g)
        out[name] = w.to(torch.bfloat16).to(device)
    return out


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


# --- one engine, in its own process ---


def build(engine_name: str, model: str, args) -> object:
    max_len = max(args.prompt_len + args.new_tokens, CHECK_PROMPT_LEN + CHECK_NEW)
    util = args.gpu_memory_utilization
    if engine_name == "vllm":
        from services.rollout.vllm.engine import VllmEngine

        return VllmEngine(
            model, dtype=vllm_dtype(args.device), gpu_memory_utilization=util,
            max_num_seqs=max(args.batches), max_model_len=max_len, device=args.device,
        )  # fmt: skip
    if engine_name == "vllm_bare":
        return BareVllm(model, args)
    if args.device == "cuda":
        from services.rollout.fast.engine import FastEngine

        return FastEngine(
            model, dtype="bfloat16", device="cuda", max_num_seqs=max(args.batches),
            gpu_memory_utilization=util, max_model_len=max_len,
        )  # fmt: skip
    from services.rollout.native.engine import NativeEngine

    return NativeEngine(model, dtype="float32", device="cpu", max_model_len=max_len)


def vllm_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


class BareVllm:
    """``vllm.LLM`` alone: built as meshrl's vLLM engine builds it (less the worker
    extension) and timed through ``LLM.generate`` with no meshrl code in the call."""

    def __init__(self, model: str, args):
        from services.rollout.vllm.mapping import CPU_ENV, llm_device_kwargs

        if args.device == "cpu":
            for key, value in CPU_ENV.items():
                os.environ.setdefault(key, value)
        import vllm

        max_len = max(args.prompt_len + args.new_tokens, CHECK_PROMPT_LEN + CHECK_NEW)
        self.llm_kwargs = dict(
            model=model, skip_tokenizer_init=True, dtype=vllm_dtype(args.device),
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=max(args.batches), max_model_len=max_len, seed=0,
            tensor_parallel_size=1, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            **llm_device_kwargs(args.device, model, max(args.batches), max_len, False),
        )  # fmt: skip
        self.vllm = vllm
        self.llm = vllm.LLM(**self.llm_kwargs)
        self.settings: dict = {}  # per sampling name: the SamplingParams keywords it used

    def sampling_kwargs(self, count: int, max_tokens: int, seed: int | None, logprobs: bool):
        """What meshrl's engine asks of vLLM for ``count`` prompts (mapping.py's
        ``per_prompt_kwargs``; the model has no EOS, so no stop tokens), written out."""
        kwargs = {
            "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens,
            "logprobs": 0 if logprobs else None, "stop_token_ids": [], "detokenize": False,
        }  # fmt: skip
        if seed is None:
            return [kwargs] * count
        base = (seed * 0x9E3779B97F4A7C15) % 2**63  # mapping.PROMPT_SEED_SPREAD
        return [{**kwargs, "seed": (base + i) % 2**63} for i in range(count)]

    def timed(self, prompt_ids: list[list[int]], kwargs: list[dict]) -> int:
        """One ``LLM.generate``; returns the new tokens."""
        sampling = [self.vllm.SamplingParams(**k) for k in kwargs]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)


def greedy(engine, prompts) -> list[list[int]]:
    from services.rollout.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=CHECK_NEW)
    return engine.generate(prompts, params).responses.tolist()


def sync_vllm(engine, weights: dict[str, torch.Tensor]) -> dict:
    """Sends ``weights`` to vLLM's worker over CUDA IPC, as the actor does, while the engine
    sleeps; returns the memory figures and the sync's time."""
    from meshrl.weight_sync import plan_buckets
    from meshrl.weight_sync.cuda_ipc import IpcGroup
    from meshrl.weight_sync.types import GroupSpec, WeightManifest

    memory = {"generating_gib": used_gib()}
    engine.release_memory()
    torch.cuda.synchronize()
    memory["asleep_gib"] = used_gib()
    store, spec = IpcGroup.open("127.0.0.1", timeout_s=120, world_size=2)
    member = GroupSpec(**{**spec.__dict__, "rank": 1})
    box: dict = {}
    joining = threading.Thread(target=lambda: box.update(intake=engine.join_weight_group(member)))
    joining.start()
    sender = IpcGroup.join(spec, store)
    joining.join(150)
    named = [(n, tuple(t.shape)) for n, t in weights.items()]
    manifest = WeightManifest(1, plan_buckets(named, torch.bfloat16, 256 * 2**20), spec.group_id)
    manifest.ipc_handles = sender.export_ring(manifest)
    receiving = threading.Thread(
        target=lambda: box.update(received=box["intake"].receive(manifest, nullcontext()))
    )
    start = time.perf_counter()
    receiving.start()
    sent_bytes, _ = sender.send(iter(weights.items()), manifest)
    receiving.join(150)
    seconds = time.perf_counter() - start
    memory["weights_awake_gib"] = used_gib()
    engine.resume_memory()
    memory["awake_gib"] = used_gib()
    box["intake"].close()
    sender.close()
    return {
        "memory": memory,
        "sync_s": seconds,
        "sent_bytes": sent_bytes,
        "received": list(box["received"]),
        "weight_version": engine.weight_version,
    }


def checks(engine_name: str, engine, model: str, args) -> dict:
    from benchmarks.rollout.engine import random_prompts

    prompts = random_prompts(7, CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_PROMPT_LEN, 1000)
    before = greedy(engine, prompts)
    weights = perturbed_weights(model, args.device)
    result: dict = {}
    if engine_name == "vllm":
        result = sync_vllm(engine, weights)
        names = [n for n in CHECKSUM_NAMES if n in weights]
        served = engine.served_checksums(names)
        result["checksums"] = {
            n: {"served": s, "sent": float(weights[n].double().sum())}
            for n, s in zip(names, served, strict=True)
        }
    else:
        engine.load_weights(weights.items())
    after = greedy(engine, prompts)
    return {**result, "greedy_before": before, "greedy_after": after}


def speed(engine, batch: int, args, seed: int | None = 1, logprobs: bool = True) -> dict:
    """New tokens/s at ``batch``. ``seed``: the request's (each prompt then gets a seed of its
    own, as in training runs); None samples unseeded. ``logprobs``: the sampled tokens'
    log-probs asked for (only vLLM computes them on request alone)."""
    from benchmarks.rollout.engine import random_prompts
    from services.rollout.types import SamplingParams

    params = SamplingParams(
        temperature=1.0, max_tokens=args.new_tokens, seed=seed, logprobs=logprobs
    )
    prompts = random_prompts(100 + batch, batch, args.prompt_len, args.prompt_len, 1000)
    if isinstance(engine, BareVllm):  # the requests built here; vLLM's own call timed
        ids = prompts.tolist()
        kwargs = engine.sampling_kwargs(batch, args.new_tokens, seed, logprobs)

        def call() -> int:
            return engine.timed(ids, kwargs)
    else:
        kwargs = None

        def call() -> int:
            return engine.generate(prompts, params).responses.values.numel()

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    start = time.perf_counter()
    call()  # warm-up: graphs of this shape, compiles
    first = time.perf_counter() - start
    rates = []
    for _ in range(args.runs):
        sync()
        start = time.perf_counter()
        new_tokens = call()
        sync()
        rates.append(new_tokens / (time.perf_counter() - start))
    out = {"tok_s": rates, "median_tok_s": statistics.median(rates), "first_call_s": first}
    if kwargs is not None:
        out["sampling_params"] = {"first_prompt": kwargs[0], "prompts": len(kwargs)}
    return out


def worker(args) -> None:
    start = time.perf_counter()
    engine = build(args.engine, args.model, args)
    result: dict = {"engine": args.engine, "startup_s": time.perf_counter() - start}
    if args.engine.startswith("vllm"):
        import vllm

        result["vllm_version"] = vllm.__version__
    if isinstance(engine, BareVllm):
        result["llm_kwargs"] = {k: v for k, v in engine.llm_kwargs.items() if k != "model"}
    if args.checks:
        result["checks"] = checks(args.engine, engine, args.model, args)
    for i, name in enumerate(args.samplings):
        seed, logprobs = SAMPLINGS[name]
        timed = {str(b): speed(engine, b, args, seed, logprobs) for b in args.batches}
        result["speed" if i == 0 else f"speed_{name}"] = timed
    result["samplings"] = {
        name: {"seed": SAMPLINGS[name][0], "logprobs": SAMPLINGS[name][1]}
        for name in args.samplings
    }
    Path(args.result).write_text(json.dumps(result))


# --- the orchestrator ---


def run_worker(engine: str, model: str, shape: str, args, out: Path) -> dict:
    result = out / f"_{shape}_{engine}.json"
    cmd = [
        sys.executable, "-m", "benchmarks.rollout.engines_side_by_side", "--worker",
        "--engine", engine, "--model", model, "--result", str(result),
        "--batches", ",".join(map(str, args.batches)), "--runs", str(args.runs),
        "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--device", args.device, "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    if shape == args.check_shape and engine != "vllm_bare":
        cmd.append("--checks")
    cmd += ["--samplings", ",".join(args.samplings)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        return {"engine": engine, "error": f"exit {proc.returncode}", "log": proc.stderr[-4000:]}
    data = json.loads(result.read_text())
    result.unlink()
    return {**data, "wall_s": wall}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Rows equal, tokens equal at the same position, and first tokens equal. Random bf16
    weights: once two greedy runs differ by one token, their continuations part, so the
    first token (the prompt's argmax) is the cleanest test that the weights are the same."""
    pairs = list(zip(a, b, strict=True))
    tokens = [p == q for x, y in pairs for p, q in zip(x, y, strict=False)]
    return {
        "rows_equal": sum(x == y for x, y in pairs) / len(pairs),
        "tokens_equal": sum(tokens) / max(1, len(tokens)),
        "first_tokens_equal": sum(x[:1] == y[:1] for x, y in pairs) / len(pairs),
    }


def compare(results: dict) -> dict:
    """The checks across engines: vLLM after the sync against the fast engine on the same
    weights, and against itself before the sync."""
    native, vllm = results.get("native", {}), results.get("vllm", {})
    if "checks" not in native or "checks" not in vllm:
        return {}
    n, v = native["checks"], vllm["checks"]
    return {
        "vllm_after_vs_native_after": agreement(v["greedy_after"], n["greedy_after"]),
        "vllm_before_vs_native_before": agreement(v["greedy_before"], n["greedy_before"]),
        "vllm_after_vs_vllm_before": agreement(v["greedy_after"], v["greedy_before"]),
    }


def table(report: dict) -> str:
    lines = ["shape  engine  batch  new tok/s (runs)                 startup s"]
    for shape, per_engine in report["shapes"].items():
        for engine, r in per_engine.items():
            if engine == "compare":
                continue
            if "error" in r:
                lines.append(f"{shape:6} {engine:7} error: {r['error']}")
                continue
            for kind in [k for k in r if k.startswith("speed")]:
                name = engine if kind == "speed" else f"{engine} ({kind[6:]})"
                for batch, s in r[kind].items():
                    runs = ", ".join(f"{x:,.0f}" for x in s["tok_s"])
                    lines.append(f"{shape:6} {name:7} {batch:>5}  {runs:32} {r['startup_s']:.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="native")
    parser.add_argument("--model", default="")
    parser.add_argument("--result", default="")
    parser.add_argument("--checks", action="store_true")
    parser.add_argument(
        "--samplings",
        default="seeded_logprobs",
        help=f"sampling settings timed, the first as `speed` ({', '.join(SAMPLINGS)})",
    )
    parser.add_argument(
        "--unseeded", action="store_true", help="also time unseeded sampling (= +logprobs)"
    )
    parser.add_argument("--check-shape", default="0.5b", help="the shape the checks run on")
    parser.add_argument("--engines", default="native,vllm,vllm_bare")
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--workdir", default="/tmp/meshrl_engines")
    parser.add_argument("--worker-timeout-s", type=float, default=420)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.samplings = [s for s in str(args.samplings).split(",") if s]
    if args.unseeded and "logprobs" not in args.samplings:
        args.samplings.append("logprobs")
    if unknown := [s for s in args.samplings if s not in SAMPLINGS]:
        parser.error(f"--samplings: unknown {unknown}; known: {', '.join(SAMPLINGS)}")
    if args.worker:
        worker(args)
        return
    args.shapes = args.shapes.split(",")
    out, root = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": platform.node(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
        },
        "shapes": {},
    }
    for shape in args.shapes:
        model = make_folder(shape, root, args.device)
        per_engine: dict = {}
        for engine in args.engines.split(","):
            per_engine[engine] = run_worker(engine, model, shape, args, out)
            print(shape, engine, json.dumps({k: v for k, v in per_engine[engine].items()
                                              if k != "checks"})[:1500], flush=True)  # fmt: skip
        per_engine["compare"] = compare(per_engine)
        for r in per_engine.values():  # the token lists served the comparison: keep it small
            for key in ("greedy_before", "greedy_after"):
                r.get("checks", {}).pop(key, None)
        report["shapes"][shape] = per_engine
        (out / "rollout_engines_side_by_side.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    for shape, per_engine in report["shapes"].items():
        print(shape, "checks:", json.dumps(per_engine.get("compare")))
        v = per_engine.get("vllm", {}).get("checks", {})
        if v:
            print("vllm sync:", json.dumps({k: v[k] for k in v if not k.startswith("greedy")}))


if __name__ == "__main__":
    main()
