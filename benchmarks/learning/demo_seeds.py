"""`make demo` over seeds: held-out greedy accuracy before and after PPO, and PPO's wall time.

    .venv/bin/python -m benchmarks.learning.demo_seeds [--seeds 1 2 3] [--out DIR]

Each seed is one `meshrl demo --out DIR/seed<s> trainer.seed=<s> data.seed=<s>`, run one
after another in a fresh process: the demo's config as it is, the seed changed. A seed sets
the model's initial weights, the warm start's problem order and hence where it stops, the
order of the training prompts and PPO's sampling; the data set (4096 training and 128
held-out problems) is the same for every seed. From each run's `metrics.jsonl`:
`val-core/openai/gsm8k/acc/mean@1` (greedy, temperature 0, on the 128 held-out problems) at
step 0 and at the last step; from its output: the warm start's iterations and the PPO run's
wall time (role servers' start-up included). Prints a table and writes
``benchmarks/results/learning_cpu_demo_seeds.json`` (docs/learning.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "learning_cpu_demo_seeds.json"


def run_seed(seed: int, out: Path) -> dict:
    from meshrl_app.demo.run import held_out_accuracy
    from services.coordinator.metrics.sinks import read_jsonl

    cmd = [sys.executable, "-m", "meshrl_app.cli", "demo", "--out", str(out)]
    cmd += [f"trainer.seed={seed}", f"data.seed={seed}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"seed {seed}: meshrl demo exited {proc.returncode}")
    warm = re.search(r"warm start: (\d+) iterations in (\d+)s", proc.stdout)
    ppo_s = float(re.search(r"PPO run: (\d+)s", proc.stdout).group(1))
    val = held_out_accuracy(read_jsonl(out / "run" / "metrics.jsonl"))
    (_, a0), (s1, a1) = val[0], val[-1]
    return {
        "seed": seed,
        "warm_start_iterations": int(warm.group(1)),
        "warm_start_s": float(warm.group(2)),
        "acc_step0": a0,
        "acc_final": a1,
        "final_step": s1,
        "delta": round(a1 - a0, 4),
        "acc_by_step": dict(val),
        "ppo_wall_s": ppo_s,
        "command": " ".join(["meshrl", *cmd[3:]]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", type=Path, default=None, help="run folders (default: a temp dir)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="demo_seeds_"))
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, root / f"seed{seed}"))
        r = runs[-1]
        print(
            f"seed {seed}: warm start {r['warm_start_iterations']} it, held-out greedy "
            f"accuracy {r['acc_step0']:.3f} -> {r['acc_final']:.3f} ({r['delta']:+.3f}), "
            f"PPO {r['ppo_wall_s']:.0f}s",
            flush=True,
        )
    deltas = [r["delta"] for r in runs]
    summary = {
        "mean_acc_step0": statistics.mean(r["acc_step0"] for r in runs),
        "mean_acc_final": statistics.mean(r["acc_final"] for r in runs),
        "mean_delta": statistics.mean(deltas),
        "min_delta": min(deltas),
        "max_ppo_wall_s": max(r["ppo_wall_s"] for r in runs),
    }
    print("\n| seed | warm-start it | step-0 acc | final acc | delta | PPO wall s |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['seed']} | {r['warm_start_iterations']} | {r['acc_step0']:.3f} | "
            f"{r['acc_final']:.3f} | {r['delta']:+.3f} | {r['ppo_wall_s']:.0f} |"
        )
    print(
        f"| mean | | {summary['mean_acc_step0']:.3f} | {summary['mean_acc_final']:.3f} | "
        f"{summary['mean_delta']:+.3f} | |"
    )
    result = {
        "benchmark": "learning_cpu_demo_seeds",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "runs": runs,
        "summary": summary,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
