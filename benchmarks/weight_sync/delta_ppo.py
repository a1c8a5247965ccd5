"""Full against delta weight sync over gloo, through 20 real PPO updates of a ~106M model.

    python -m benchmarks.weight_sync.delta_ppo [--steps 20] [--lrs 3e-4,1e-6]

What runs: the actor trainer server and one rollout server (the native engine, bf16
weights) as their own processes, started by the local launcher on this machine, and the
coordinator's ``WeightSyncer`` (this process) between them; the weights cross from the
actor's process to the rollout's over gloo (loopback). The model is a Llama of 106.3M
parameters built from a config (hidden 768, 15 layers, 12 heads, intermediate 2048, the
22-symbol character vocabulary, random init, float32 masters in the actor), not a
pretrained one.

Each step is a real, if small, PPO update: the rollout server generates 2 prompts (8 tokens)
x 4 samples of 8 tokens (temperature 1, seeded per step) with the weights it was last sent;
a seeded random reward per response gives group-normalised advantages (GRPO-style, one
value per response; a rule reward saturates within 3 steps on this random-init model at
lr 3e-4, and every advantage is 0 from then on); the actor computes the old log-probs and
runs ``UpdatePolicy`` (the clipped PPO loss, one AdamW step, grad clip 1.0). Then the
weights go to the rollout as version ``step``: every bucket dense (``weight_sync.delta``
off, what meshrl sent before) or only what changed (on). Each learning rate runs twice,
full then delta, from the same initial weights and seeds; the rewards and losses of the
two runs are compared, so both moved the same weights.

Per step it records the actor's bytes on the wire and its send time (``weight_sync/bytes``,
``weight_sync/seconds``: header, gather, cast, diff, checksums, broadcasts), the wall time
of the whole sync as the coordinator sees it (PrepareWeights, SendWeights and the rollout's
ReceiveWeights: receive, apply, check, load into the engine), and with deltas the fraction
of the weights' bf16 elements that changed. Writes
``benchmarks/results/weight_sync_delta_ppo_cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parents[1] / "results" / "weight_sync_delta_ppo_cpu.json"
MODEL = dict(hidden=768, layers=15, heads=12, intermediate=2048, max_positions=256)
PROMPTS, N, MAX_TOKENS = 2, 4, 8


def _prompts(step: int):
    from meshrl.ragged import Ragged

    g = torch.Generator().manual_seed(1000 + step)
    rows = [[1, *torch.randint(3, 22, (7,), generator=g).tolist()] for _ in range(PROMPTS)]
    return Ragged.from_lists(rows)


def _advantages(responses, step: int):
    """A seeded random reward per response, normalised within each prompt's group: a
    random-init model saturates any easy rule reward within 3 steps at lr 3e-4 (all
    advantages 0 from then), and this one keeps every step's policy gradient non-zero."""
    rewards = torch.rand(len(responses), generator=torch.Generator().manual_seed(step))
    groups = rewards.view(PROMPTS, N)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    per_token = torch.repeat_interleave(adv.view(-1), responses.lengths)
    return rewards, responses.with_values(per_token)


def _run(model_dir: Path, work: Path, lr: float, delta: bool, steps: int) -> dict:
    from meshrl.config import build_config, config_to_yaml
    from meshrl.launcher.local import LocalLauncher
    from services.coordinator.generation.weight_sync import WeightSyncer
    from services.rollout.client import RolloutClient
    from services.rollout.types import SamplingParams
    from services.trainer.client import TrainerClient

    cfg = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}",
        f"trainer.default_local_dir={work}",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        f"actor_rollout_ref.rollout.weight_sync.delta={str(delta).lower()}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        "critic.enable=false", "trainer.device=cpu",
    ])  # fmt: skip
    rows = []
    with LocalLauncher(cfg, work) as launcher:
        endpoints = launcher.start()
        actor = TrainerClient(endpoints.actor, 600, "actor")
        rollout = RolloutClient(endpoints.rollout[0], 600)
        text = config_to_yaml(cfg)
        actor.initialize(text)
        rollout.initialize(text)
        syncer = WeightSyncer(cfg, actor, [rollout])
        start = time.perf_counter()
        first = syncer.sync(version=0)
        rows.append({"step": 0, "wall_s": time.perf_counter() - start, **first})
        for step in range(1, steps + 1):
            prompts = _prompts(step)
            sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=N, seed=step)
            t0 = time.perf_counter()
            out = rollout.generate(prompts, sampling)
            assert out.weight_version == step - 1
            repeated = prompts.select(torch.arange(PROMPTS).repeat_interleave(N))
            rewards, adv = _advantages(out.responses, step)
            t1 = time.perf_counter()
            old, _ = actor.compute_log_probs(repeated, out.responses, 1.0)
            update = actor.update_policy(repeated, out.responses, old, adv, global_step=step)
            t2 = time.perf_counter()
            metrics = syncer.sync(version=step)
            t3 = time.perf_counter()
            rows.append({
                "step": step, "gen_s": t1 - t0, "update_s": t2 - t1, "wall_s": t3 - t2,
                "reward_mean": float(rewards.mean()),
                "pg_loss": update.get("actor/pg_loss"),
                **metrics,
            })  # fmt: skip
            print(json.dumps({"lr": lr, "delta": delta, **rows[-1]}), flush=True)
        syncer.close()
    return {"lr": lr, "delta": delta, "steps": rows}


def _summary(full: dict, delta: dict) -> dict:
    f = [r for r in full["steps"] if r["step"] > 0]
    d = [r for r in delta["steps"] if r["step"] > 0]
    same = all(
        a["reward_mean"] == b["reward_mean"] and a["pg_loss"] == b["pg_loss"]
        for a, b in zip(f, d, strict=True)
    )
    med = statistics.median
    return {
        "lr": full["lr"],
        "same_trajectory": same,
        "full_bytes_per_step": med(r["weight_sync/bytes"] for r in f),
        "delta_bytes_per_step_median": med(r["weight_sync/bytes"] for r in d),
        "delta_bytes_per_step_max": max(r["weight_sync/bytes"] for r in d),
        "bytes_ratio_median": med(r["weight_sync/bytes"] for r in d)
        / med(r["weight_sync/bytes"] for r in f),
        "changed_fraction_median": med(r["weight_sync/changed_fraction"] for r in d),
        "changed_fraction_min": min(r["weight_sync/changed_fraction"] for r in d),
        "changed_fraction_max": max(r["weight_sync/changed_fraction"] for r in d),
        "full_send_s_median": med(r["weight_sync/seconds"] for r in f),
        "delta_send_s_median": med(r["weight_sync/seconds"] for r in d),
        "full_sync_wall_s_median": med(r["wall_s"] for r in f),
        "delta_sync_wall_s_median": med(r["wall_s"] for r in d),
        "delta_first_sync_bytes": delta["steps"][0]["weight_sync/bytes"],
        "update_s_median": med(r["update_s"] for r in f + d),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lrs", default="3e-4,1e-6", help="the demo's, then verl's default")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from transformers import AutoConfig

    from meshrl.testing.tiny_model import make_tiny_model_dir

    runs, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="delta_ppo_") as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model", seed=0, **MODEL)
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            from transformers import LlamaForCausalLM

            params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        for lr in (float(x) for x in args.lrs.split(",")):
            pair = []
            for delta in (False, True):
                work = Path(tmp) / f"run_{lr:g}_{'delta' if delta else 'full'}"
                pair.append(_run(model_dir, work, lr, delta, args.steps))
            runs.extend(pair)
            summaries.append(_summary(*pair))
            print(json.dumps(summaries[-1]), flush=True)
    result = {
        "benchmark": "weight_sync_delta_ppo",
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), no GPU",
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "model": {**MODEL, "vocab": config.vocab_size, "parameters": params},
        "batch": {"prompts": PROMPTS, "n": N, "max_tokens": MAX_TOKENS},
        "transport": "gloo, actor server process to rollout server process (loopback)",
        "wire_dtype": "bfloat16",
        "summaries": summaries,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"summaries": summaries}, indent=1))


if __name__ == "__main__":
    main()
