"""PPO step time through the mesh, synchronous against one step off policy, on CPU.

    .venv/bin/python -m benchmarks.ppo.one_step_off [--steps 8] [--rounds 2]

Each round runs the same short PPO run twice through the local launcher (every role its own
server process, one thread each), once with ``trainer.one_step_off_policy=false`` and once
with ``true``, in turns (which goes first alternates). The model is a random-init tiny
Llama (hidden 128, 2 layers) on the arithmetic task, GAE with a critic, 64 prompts a step,
32 response tokens at most; both modes sample with the same seeds from the same start, so
they generate the same response lengths (the tiny lr barely moves the weights). A run's figure is the median over its steps after the first (step 1
generates its own batch in both modes) of ``perf/time_per_step`` and of each
``timing_s/*`` phase. ``speedup`` is the median over rounds of sync / off-policy step time,
each round's pair measured back to back. Prints a table and writes
``benchmarks/results/ppo_one_step_off_cpu.json``.
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

RESULTS = Path(__file__).parents[1] / "results" / "ppo_one_step_off_cpu.json"
PHASES = ("gen", "gen_wait", "reward", "old_log_prob", "values", "adv", "update_critic")
PHASES += ("update_actor", "sync_weights", "step")


def overrides(model: Path, data: dict, run_dir: Path, steps: int, off_policy: bool) -> list[str]:
    return [
        f"data.train_files=[{data['train']}]",
        "data.train_batch_size=64",
        "data.max_prompt_length=16",
        "data.max_response_length=32",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "critic.ppo_mini_batch_size=32",
        "algorithm.adv_estimator=gae",
        f"trainer.one_step_off_policy={str(off_policy).lower()}",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        f"trainer.default_local_dir={run_dir}",
    ]


def one_run(model: Path, data: dict, run_dir: Path, steps: int, off_policy: bool) -> dict:
    from meshrl.config import build_config
    from meshrl_app.run_local import run_local
    from services.coordinator.metrics.sinks import read_jsonl

    start = time.perf_counter()
    run_local(build_config({}, overrides(model, data, run_dir, steps, off_policy)))
    wall = time.perf_counter() - start
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    later = [r for r in rows if r["step"] > 1]
    figures = {
        phase: statistics.median(r.get(f"timing_s/{phase}", 0.0) for r in later) for phase in PHASES
    }
    return {
        "off_policy": off_policy,
        "step_s": statistics.median(r["perf/time_per_step"] for r in later),
        "phases_s": figures,
        "response_length": statistics.median(r["response_length/mean"] for r in later),
        "weight_lag": [r["rollout/weight_lag"] for r in rows],
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app.demo.arithmetic import write_arithmetic_parquet

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model_dir(root / "model", seed=0, hidden=128, intermediate=256)
        data = write_arithmetic_parquet(root / "data", n_train=1024, n_val=8)
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            runs = {
                mode: one_run(model, data, root / f"r{i}_{mode}", args.steps, mode)
                for mode in order
            }
            pair = {"sync": runs[False], "off_policy": runs[True]}
            pair["speedup"] = runs[False]["step_s"] / runs[True]["step_s"]
            rounds.append(pair)
            print(
                f"round {i + 1}: sync {runs[False]['step_s']:.3f} s/step, one step off policy "
                f"{runs[True]['step_s']:.3f} s/step: {pair['speedup']:.2f}x",
                flush=True,
            )
    result = {
        "command": "python -m benchmarks.ppo.one_step_off "
        f"--steps {args.steps} --rounds {args.rounds}",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "load_average_before": os.getloadavg(),
        "rounds": rounds,
        "median_speedup": statistics.median(r["speedup"] for r in rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'phase (median s)':<18}{'sync':>10}{'off policy':>12}")
    for phase in PHASES:
        sync = statistics.median(r["sync"]["phases_s"][phase] for r in rounds)
        off = statistics.median(r["off_policy"]["phases_s"][phase] for r in rounds)
        print(f"{phase:<18}{sync:>10.3f}{off:>12.3f}")
    print(f"median speedup of the step: {result['median_speedup']:.2f}x -> {args.out}")


if __name__ == "__main__":
    main()
