"""Advantage estimators compared on one task: held-out greedy accuracy before and after RL.

    python -m benchmarks.learning.estimators --device cuda --out results.json   # one H200
    python -m benchmarks.learning.estimators --smoke --out /tmp/smoke.json      # CPU check

The model (hidden 512, 6 layers, 8 heads, intermediate 1536: about 20M parameters, the
character tokenizer of `meshrl.testing`) is built from a config, then supervised on
synthetic GSM8k-format problems (three-digit addition, `Q: 123+456=` ->
`123+456=579 #### 579`) to a weak start with the demo's warm start: it stops at the first
check where greedy accuracy on 128 training problems reaches `--stop-at` (0.2). From that
same start, each estimator runs the same number of PPO steps on the same number of prompts
a step (`--batch` prompts, `--n` responses each), every run through the mesh: one set of
role servers (rollout, actor, critic, reference, reward, each its own process) started once
and initialised again by each run with its own config, as runs against `docker compose
up`'s servers are. Held-out greedy accuracy (`val-core/openai/gsm8k/acc/mean@1`, 256
problems never trained on, temperature 0) at step 0 and at the last step, wall time of the
run and tokens generated (the sum of `perf/total_num_tokens`) are recorded per estimator
and seed. A seed sets the model's initial weights, the warm start's problems and the runs'
sampling and prompt order; the data set is the same for every seed.

The estimators, as verl configures them (docs/algorithms.md):
- gae: PPO with a critic (zero-initialised value head), GAE gamma 1, lambda 0.95;
- grpo: group-normalised scores, KL to the reference as a loss (low_var_kl, 0.001);
- rloo: leave-one-out baseline in the group;
- reinforce_plus_plus: discounted return-to-go of the token rewards, whitened over the batch;
- remax: baseline from the greedy response's score (one more generation a step).
All but grpo put the demo's KL penalty (0.005) in the reward. Every estimator gets the same
`--n` (group estimators need n > 1; gae, reinforce_plus_plus and remax get as many
responses, so each sees the same samples a step).

Budget on one H200 (about 8 minutes): two warm starts of 20-40 s, one mesh start, then
2 seeds x 5 estimators runs of `--steps` 30 (about 20-30 s each, validation included).
`--smoke` runs a 2-layer hidden-64 model on two-digit addition on the CPU, 1 step per
estimator, 1 seed: a check that every estimator goes through the mesh end to end.
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

ESTIMATORS: dict[str, list[str]] = {
    "gae": ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"],
    "grpo": [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    ],
    "rloo": ["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=true"],
    "reinforce_plus_plus": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.use_kl_in_reward=true",
    ],
    "remax": ["algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=true"],
}

MODEL_20M = {"hidden": 512, "layers": 6, "heads": 8, "intermediate": 1536}
MODEL_TINY = {"hidden": 64, "layers": 2, "heads": 2, "intermediate": 128}


def prepare_model(root: Path, seed: int, args, held_out: set) -> tuple[Path, dict]:
    """The model built from its config and warm-started to a weak start (seed `seed`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app.demo.warm_start import warm_start

    shape = MODEL_TINY if args.smoke else MODEL_20M
    path = make_tiny_model_dir(root / f"model_seed{seed}", seed=seed, **shape)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    done = warm_start(
        model,
        tokenizer,
        max_iterations=args.warm_start_max,
        stop_at_accuracy=args.stop_at,
        check_every=args.check_every,
        lr=args.warm_start_lr,
        seed=seed,
        held_out=held_out,
        digits=args.digits,
    )
    model.to("cpu").save_pretrained(path)
    info = {
        "parameters": params,
        "shape": shape,
        "warm_start_iterations": done.iterations,
        "warm_start_probe_accuracy": done.probe_accuracy,
        "warm_start_s": round(time.perf_counter() - start, 1),
    }
    print(f"seed {seed}: model of {params / 1e6:.1f}M parameters, warm start {info}", flush=True)
    return path, info


def run_config(root: Path, data: dict, model: Path, estimator: str, seed: int, args):
    from meshrl_app.demo.run import demo_config

    on_gpu = args.device == "cuda"
    dtype = "bfloat16" if on_gpu else "float32"
    micro = 256 if on_gpu else 128
    overrides = [
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        f"data.train_batch_size={args.batch}",
        f"data.seed={seed}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.dtype={dtype}",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"critic.ppo_mini_batch_size={args.batch // 2}",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        f"critic.optim.lr={args.critic_lr}",
        *ESTIMATORS[estimator],
        f"trainer.device={args.device}",
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.steps}",  # step 0 and the last step
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
        "trainer.plot=false",
        "trainer.logger=[jsonl]",
        f"trainer.experiment_name={estimator}_seed{seed}",
        f"trainer.default_local_dir={root / 'runs' / f'{estimator}_seed{seed}'}",
    ]
    if on_gpu:
        overrides += ["actor_rollout_ref.rollout.gpu_memory_utilization=0.3"]
    return demo_config(root, overrides + list(args.override))


def run_one(cfg, mesh: dict) -> dict:
    """One run against the shared role servers; its figures from its metrics.jsonl."""
    from meshrl_app.demo.run import held_out_accuracy
    from meshrl_app.run_local import run_local
    from services.coordinator.metrics.sinks import read_jsonl

    cfg.launcher.kind = "external"
    cfg.launcher.addresses = mesh
    start = time.perf_counter()
    result = run_local(cfg)
    wall = time.perf_counter() - start
    rows = read_jsonl(Path(cfg.trainer.default_local_dir) / "metrics.jsonl")
    acc = held_out_accuracy(rows)
    steps = [r for r in rows if "perf/total_num_tokens" in r]
    return {
        "finished": result.finished,
        "acc_step0": acc[0][1],
        "acc_final": acc[-1][1],
        "final_step": acc[-1][0],
        "delta": round(acc[-1][1] - acc[0][1], 4),
        "wall_s": round(wall, 1),
        "tokens": int(sum(r["perf/total_num_tokens"] for r in steps)),
        "score_first": steps[0]["critic/score/mean"] if steps else None,
        "score_last": steps[-1]["critic/score/mean"] if steps else None,
        "step_s_median": statistics.median(r["perf/time_per_step"] for r in steps),
    }


def start_mesh(cfg, root: Path):
    """Role servers for every role a run may need (the gae run's config needs them all)."""
    from meshrl.launcher.local import LocalLauncher

    launcher = LocalLauncher(cfg, root / "mesh")
    launcher.__enter__()
    e = launcher.start()
    mesh = {
        "rollout": list(e.rollout),
        "actor": [e.actor],
        "critic": [e.critic],
        "ref": [e.ref],
        "reward": [e.reward],
    }
    return launcher, mesh


def print_table(runs: list[dict]) -> None:
    print("\n| estimator | seed | step-0 acc | final acc | delta | wall s | tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['estimator']} | {r['seed']} | error: {r['error'][:60]} | | | | |")
            continue
        print(
            f"| {r['estimator']} | {r['seed']} | {r['acc_step0']:.3f} | {r['acc_final']:.3f} | "
            f"{r['delta']:+.3f} | {r['wall_s']:.0f} | {r['tokens']} |"
        )
    print("\n| estimator | mean delta | mean final acc | mean wall s |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(r["estimator"] for r in runs):
        ok = [r for r in runs if r["estimator"] == name and "error" not in r]
        if ok:
            print(
                f"| {name} | {statistics.mean(r['delta'] for r in ok):+.3f} | "
                f"{statistics.mean(r['acc_final'] for r in ok):.3f} | "
                f"{statistics.mean(r['wall_s'] for r in ok):.0f} |"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=30, help="PPO steps of every run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    ap.add_argument("--batch", type=int, default=64, help="prompts a step")
    ap.add_argument("--n", type=int, default=4, help="responses a prompt, every estimator")
    ap.add_argument("--lr", type=float, default=1e-4, help="actor learning rate")
    ap.add_argument("--critic-lr", type=float, default=3e-4)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--stop-at", type=float, default=0.2, help="warm start's probe accuracy")
    ap.add_argument("--warm-start-max", type=int, default=3000)
    ap.add_argument(
        "--check-every",
        type=int,
        default=25,
        help="warm-start iterations between probes (a probe is 24 greedy decode steps)",
    )
    ap.add_argument("--warm-start-lr", type=float, default=1e-3)
    ap.add_argument("--n-val", type=int, default=256, help="held-out problems")
    ap.add_argument("--n-train", type=int, default=8192, help="training prompts")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("learning_estimators.json"))
    ap.add_argument(
        "--override", action="append", default=[], help="a config key=value for every run"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check: tiny model, two-digit addition, 1 step per estimator, 1 seed",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.steps, args.seeds, args.digits = "cpu", 1, args.seeds[:1], 2
        args.batch, args.n_val, args.n_train, args.warm_start_max = 16, 16, 1024, 400
        args.check_every = 10
        args.lr, args.critic_lr, args.warm_start_lr = 3e-4, 1e-3, 3e-3
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here (use --device cpu, or --smoke)")
    return args


def main(argv: list[str] | None = None) -> int:
    from meshrl_app.demo.arithmetic import read_problems, write_arithmetic_parquet

    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="learning_estimators_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = write_arithmetic_parquet(
        root / "data", n_train=args.n_train, n_val=args.n_val, seed=0, digits=args.digits
    )
    held_out = read_problems(data["test"])
    models = {s: prepare_model(root, s, args, held_out) for s in args.seeds}
    first = args.seeds[0]
    launcher, mesh = start_mesh(run_config(root, data, models[first][0], "gae", first, args), root)
    runs = []
    try:
        for seed in args.seeds:
            model, info = models[seed]
            for name in args.estimators:
                cfg = run_config(root, data, model, name, seed, args)
                try:
                    r = {"estimator": name, "seed": seed, **info, **run_one(cfg, mesh)}
                except Exception as e:  # noqa: BLE001 - one failing still leaves the others
                    r = {"estimator": name, "seed": seed, "error": f"{type(e).__name__}: {e}"}
                runs.append(r)
                write_result(args, runs, t0)  # so far: a call cut short keeps what ran
                print(
                    f"[{time.perf_counter() - t0:.0f}s] {name} seed {seed}: "
                    + (
                        r["error"]
                        if "error" in r
                        else f"{r['acc_step0']:.3f} -> {r['acc_final']:.3f} "
                        f"({r['delta']:+.3f}), {r['wall_s']:.0f}s, {r['tokens']} tokens"
                    ),
                    flush=True,
                )
    finally:
        launcher.__exit__(None, None, None)
    print_table(runs)
    result = write_result(args, runs, t0)
    print(f"total {result['total_s']:.0f}s; wrote {args.out}")
    return 0 if all("error" not in r for r in runs) else 1


def write_result(args, runs: list[dict], t0: float) -> dict:
    result = {
        "benchmark": "learning_estimators",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "total_s": round(time.perf_counter() - t0, 1),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
