"""Whole PPO steps through the real mesh: every role server a process, the coordinator
driving them over gRPC, on GPUs (issue 6: one H200, all co-located; issue 9: split).

    python3 -m benchmarks.ppo.step --variants colocated,colocated_keep_cache --out $OUT
    python3 -m benchmarks.ppo.step --tiny --device cpu --variants colocated   # a dry run
    python3 -m benchmarks.ppo.step --verl-defaults --variants colocated --tag _v
    python3 -m benchmarks.ppo.step --shape 3b --variants colocated_offload --tag _3b
    python3 -m benchmarks.ppo.step --variants colocated,colocated_megatron   # FSDP2 vs Megatron

The model has Qwen2.5-0.5B's shape with random weights (no hub here) and no EOS, so every
response runs to its full length; the prompts are random character strings of the chosen
token length under the character tokenizer (one token each). Step 1 pays for compiling and
CUDA-graph capture; the figures are from the steps after it. Each variant writes
``$OUT/ppo_step_<variant>.json`` with every step's ``timing_s/*`` and ``perf/*`` metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from meshrl.testing.char_tokenizer import CHARS, save_char_tokenizer
from meshrl.testing.tiny_model import make_tiny_qwen2_dir

# Trainer micro-batches packed to 16k tokens, padding-free (varlen attention).
PADDING_FREE = [
    "actor_rollout_ref.model.use_remove_padding=true",
    "critic.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
    "critic.ppo_max_token_len_per_gpu=16384",
]

# LoRA adapters of rank 32 on every linear layer of the actor and the critic (base frozen).
LORA = [
    "actor_rollout_ref.model.lora_rank=32",
    "actor_rollout_ref.model.lora_alpha=64",
    "critic.model.lora_rank=32",
    "critic.model.lora_alpha=64",
]

# The trainer roles as one process each would hold them: every state in GPU memory.
OFFLOAD = [
    "actor_rollout_ref.actor.param_offload=true",
    "actor_rollout_ref.actor.optimizer_offload=true",
    "critic.param_offload=true",
    "critic.optimizer_offload=true",
    "actor_rollout_ref.ref.param_offload=true",
]
MEGATRON = [
    "actor_rollout_ref.actor.strategy=megatron",
    "actor_rollout_ref.ref.strategy=megatron",
    "critic.strategy=megatron",
]
EAGER = ["actor_rollout_ref.actor.use_torch_compile=false", "critic.use_torch_compile=false"]
NO_RECOMPUTE = [
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "critic.model.enable_gradient_checkpointing=false",
]

# Placement and settings of each variant (launcher.role_gpus plus what changes with it).
# The defaults on a GPU: compiled decoder layers, recomputed activations, the rollout's
# KV cache given back while the trainers run, actor and critic updates one after the other.
VARIANTS: dict[str, list[str]] = {
    # One GPU for all roles, the defaults.
    "colocated": [],
    # As colocated, with vLLM as the rollout engine (asleep while the trainers run; the
    # actor's weights reach its worker by CUDA IPC).
    "colocated_vllm": ["actor_rollout_ref.rollout.name=vllm"],
    # The trainers' weights and optimizer moments in CPU memory between their calls.
    "colocated_offload": OFFLOAD,
    "colocated_vllm_offload": ["actor_rollout_ref.rollout.name=vllm", *OFFLOAD],
    # Without compiled layers / without recomputed activations (what they cost or give).
    "colocated_eager": EAGER,
    "colocated_no_recompute": NO_RECOMPUTE,
    # One GPU, the KV cache (and its CUDA graphs) kept between steps.
    "colocated_keep_cache": ["actor_rollout_ref.rollout.free_cache_engine=false"],
    # One GPU, padding-free.
    "colocated_padding_free": PADDING_FREE,
    # One step off policy: the next batch generated while the step trains.
    "colocated_one_step_off": ["trainer.one_step_off_policy=true"],
    # Fully async training, samples at most 1 or 2 weight versions behind.
    "colocated_async1": [
        "trainer.async_training.enable=true",
        "trainer.async_training.max_staleness=1",
    ],
    "colocated_async2": [
        "trainer.async_training.enable=true",
        "trainer.async_training.max_staleness=2",
    ],
    # The reference's weights in CPU memory between its passes.
    "colocated_ref_offload": ["actor_rollout_ref.ref.param_offload=true"],
    # LoRA actor and critic: rollout receives the merged weights.
    "colocated_lora": LORA,
    # As colocated, with actor, critic and reference on the Megatron-Core backend
    # (tensor and pipeline parallel 1): its step time and perf/mfu/actor beside FSDP2's.
    "colocated_megatron": MEGATRON,
    # Rollout on GPU 1, actor + critic + ref on GPU 0; weights by NCCL.
    "split": ["launcher.role_gpus={rollout: '1', actor: '0', critic: '0', ref: '0'}"],
}


# verl's quick start names no device or dtype, only its placement: here that asks for one
# GPU (trainer.device=cuda, verl's default) and, with it, bf16 compute (--verl-defaults).
VERL_PLACEMENT = [
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
]


def write_prompts(path: Path, rows: int, prompt_tokens: int, seed: int = 0) -> None:
    """verl-schema parquet; the chat template adds BOS, so each prompt is exactly
    ``prompt_tokens`` tokens."""
    rng = random.Random(seed)
    # No spaces: in a Qwen2 model folder transformers loads the char tokenizer as its
    # Qwen2Tokenizer class, which drops them (the prompts would come out shorter).
    body = [c for c in CHARS if c not in "# "]
    records = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "user", "content": "".join(rng.choices(body, k=prompt_tokens - 1))}
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(rng.randint(0, 99))},
            "extra_info": {"index": i},
        }
        for i in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(records), path)


def make_model(path: Path, tiny: bool, shape: str = "0.5b") -> str:
    """The Qwen2.5-0.5B shape (or, with --tiny, a 2-layer hidden-64 Qwen2 with its
    vocabulary) + the char tokenizer."""
    from benchmarks.gpu_models import make_model_dir

    if (path / "config.json").exists():
        return str(path)
    if tiny:
        make_tiny_qwen2_dir(path, vocab_size=151936, max_positions=32768)
    else:
        make_model_dir(path, shape=shape)
        save_char_tokenizer(path)
    return str(path)


def step_config(workdir: Path, model: str, args, variant: str):
    from meshrl.config import build_config

    data = workdir / "data.parquet"
    rows = args.batch * (args.steps + 1)
    write_prompts(data, rows, args.prompt_len)
    micro = args.micro
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    placement = VERL_PLACEMENT if args.verl_defaults else []
    overrides = [
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.dtype={dtype}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * micro}",
        f"critic.ppo_mini_batch_size={args.mini}",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        "critic.ppo_epochs=1",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",  # the reference role runs every step
        f"trainer.device={args.device}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.rpc_timeout_s=900",
        f"trainer.default_local_dir={workdir / ('run_' + variant)}",
        "launcher.startup_timeout_s=600",
        "reward.num_workers=4",
        *placement,
        *VARIANTS[variant],
        *args.override,
    ]
    return build_config({}, overrides)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(steps: list[dict]) -> dict:
    """Median over the steps after the first of the metrics a step's cost is read from."""
    later = steps[1:] or steps
    # timings, throughput/MFU, and how far the engine's log-probs are from the actor's
    kept = ("timing_s/", "perf/", "training/rollout_probs_diff", "response_length/mean")
    keys = sorted({k for s in later for k in s if k.startswith(kept)})
    return {k: statistics.median(float(s[k]) for s in later if k in s) for k in keys}


def run_variant(variant: str, workdir: Path, model: str, args) -> dict:
    from benchmarks.ppo.gpu_memory import MemorySampler
    from meshrl_app.run_local import run_local

    cfg = step_config(workdir, model, args, variant)
    shutil.rmtree(cfg.trainer.default_local_dir, ignore_errors=True)
    start = time.perf_counter()
    with MemorySampler() as memory:
        try:
            run_local(cfg)
        finally:
            memory_gib = memory.report() if args.device == "cuda" else {}
    wall = time.perf_counter() - start
    run_dir = Path(cfg.trainer.default_local_dir)
    steps = read_metrics(run_dir)
    return {
        "variant": variant,
        "placement": dict(cfg.launcher.role_gpus) or "all roles on one GPU",
        "resolved": {
            "trainer.device": cfg.trainer.device,
            "actor_rollout_ref.model.dtype": cfg.actor_rollout_ref.model.dtype,
            "actor_rollout_ref.rollout.dtype": cfg.actor_rollout_ref.rollout.dtype,
        },
        "wall_s": wall,
        "gpu_memory_per_phase": memory_gib,
        "median_after_first": summarize(steps),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="colocated")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--workdir", default="/tmp/meshrl_ppo_step")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model (dry runs)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shape", default="0.5b", help="Qwen2.5 shape: 0.5b, 1.5b, 3b, 7b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--mini", type=int, default=64, help="ppo_mini_batch_size")
    parser.add_argument("--micro", type=int, default=16, help="ppo_micro_batch_size_per_gpu")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--override", action="append", default=[], help="extra config key=value")
    parser.add_argument("--tag", default="", help="suffix of the output files' names")
    parser.add_argument(
        "--verl-defaults",
        action="store_true",
        help="no device or dtype given, only verl's quick-start placement keys",
    )
    args = parser.parse_args()
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = "model_tiny" if args.tiny else f"model_{args.shape}"
    model = make_model(workdir / folder, args.tiny, args.shape)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "args": vars(args),
    }
    for variant in args.variants.split(","):
        try:
            result = {"meta": meta, **run_variant(variant, workdir, model, args)}
        except Exception as e:  # noqa: BLE001 - one variant failing still leaves the others
            result = {"meta": meta, "variant": variant, "error": f"{type(e).__name__}: {e}"}
            logs = workdir / f"run_{variant}" / "logs"
            if logs.is_dir():  # the servers' last words, for the report
                result["log_tails"] = {p.name: p.read_text()[-3000:] for p in logs.glob("*.log")}
        (out / f"ppo_step_{variant}{args.tag}.json").write_text(
            json.dumps(result, indent=1, default=str)
        )
        summary = result.get("median_after_first", result.get("error"))
        print(variant, json.dumps(summary, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
