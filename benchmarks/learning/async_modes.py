"""The demo's task at equal steps in three modes, one run side by side: synchronous, one step
off policy (`trainer.one_step_off_policy`) and fully async (`trainer.async_training`).

    .venv/bin/python -m benchmarks.learning.async_modes [--steps 60] [--rounds 2] [--out DIR]

One warm start (the demo's, seed 1: `meshrl_app.demo.run.prepare_model`, kept in
``DIR/model`` and reused), then one PPO run a mode through the mesh (every role its own
server process), one after another, the order rotated each round (``--rounds``): the
demo's config as it is (GAE with a critic, 256
prompts a step, KL in the reward), ``--steps`` steps, held-out greedy validation at step 0
and at the last step, no checkpoint, requests of 64 prompts in every mode
(`rollout.prompts_per_request`). Fully async: `max_staleness` 1, `stale` wait, a buffer of 2
batches, decoupled PPO's behaviour weight (`tis_imp_ratio_cap` 2, its default there).

From each run's `metrics.jsonl`: the median `timing_s/step` over steps 2 on (step 1
generates its own batch in every mode), the run's wall time over its steps, held-out greedy
accuracy (`val-core/openai/gsm8k/acc/mean@1`) at step 0 and at the last step, and for the
async run its staleness, drops and idle times. Prints a table and writes
``benchmarks/results/learning_cpu_async_modes.json`` (docs/learning.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "learning_cpu_async_modes.json"

MODES: dict[str, list[str]] = {
    "sync": [],
    "one_step_off": ["trainer.one_step_off_policy=true"],
    "async": [
        "trainer.async_training.enable=true",
        "trainer.async_training.max_staleness=1",
        "trainer.async_training.stale=wait",
        "trainer.async_training.buffer_batches=2",
    ],
    # The same, samples up to two weight versions behind.
    "async2": [
        "trainer.async_training.enable=true",
        "trainer.async_training.max_staleness=2",
        "trainer.async_training.stale=wait",
        "trainer.async_training.buffer_batches=3",
    ],
}


def run_mode(
    out: Path, mode: str, steps: int, extra: list[str], round_: int = 0, test_freq: int = 0
) -> dict:
    """``test_freq``: validate every this many steps (0: at step 0 and the last only)."""
    from meshrl_app.demo.run import demo_config, held_out_accuracy
    from meshrl_app.run_local import run_local
    from services.coordinator.metrics.sinks import read_jsonl

    run_dir = out / f"run_{mode}_{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no earlier metrics.jsonl lines
    overrides = [
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq or steps}",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "actor_rollout_ref.rollout.prompts_per_request=64",
        *MODES[mode],
        *extra,
    ]
    start = time.perf_counter()
    run_local(demo_config(out, overrides))
    wall = time.perf_counter() - start
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps_rows = {r["step"]: r for r in rows if "timing_s/step" in r}
    step_s = [steps_rows[s]["timing_s/step"] for s in sorted(steps_rows)]
    val = held_out_accuracy(rows)
    (_, a0), (s1, a1) = val[0], val[-1]
    result = {
        "mode": mode,
        "round": round_,
        "overrides": overrides,
        "steps": len(step_s),
        "median_step_s": statistics.median(step_s[1:] or step_s),
        "sum_step_s": sum(step_s),
        "run_wall_s": wall,
        "acc_step0": a0,
        "acc_final": a1,
        "final_step": s1,
        "acc_by_step": [[s, a] for s, a in val],
        "delta": round(a1 - a0, 4),
    }
    later = [steps_rows[s] for s in sorted(steps_rows)[1:]]

    def median(key: str) -> float | None:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else None

    for key in (
        "timing_s/gen",
        "timing_s/gen_wait",
        "timing_s/trainer_idle",
        "timing_s/rollout_idle",
        "timing_s/gen_drain",
        "timing_s/sync_weights",
        "async/staleness/mean",
        "async/buffer_depth",
    ):
        if (value := median(key)) is not None:
            result[f"median {key}"] = value
    if mode.startswith("async"):
        result["async/dropped_samples total"] = sum(r["async/dropped_samples"] for r in later)
        result["async/staleness/max over the run"] = max(
            r["async/staleness/max"] for r in steps_rows.values()
        )
    return result


def main(argv: list[str] | None = None) -> dict:
    import torch

    from meshrl_app.demo.arithmetic import read_problems, write_arithmetic_parquet
    from meshrl_app.demo.run import DIGITS, prepare_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1, help="each mode once a round")
    ap.add_argument(
        "--modes", nargs="+", default=["sync", "one_step_off", "async"], choices=list(MODES)
    )
    ap.add_argument("--out", type=Path, default=None, help="run folders (default: a temp dir)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--override", action="append", default=[], help="a config key=value, all")
    ap.add_argument("--test-freq", type=int, default=0, help="validate every N steps too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as `meshrl demo`: the tiny model's matmuls on one thread
    out = (args.out or Path(tempfile.mkdtemp(prefix="async_modes_"))).resolve()
    data = write_arithmetic_parquet(out / "data", digits=DIGITS)
    prepare_model(out, read_problems(data["test"]), seed=1)
    load_before = os.getloadavg()
    runs = []
    for round_ in range(args.rounds):
        # the order rotated each round: no mode always runs first, or last, on a busy box
        k = round_ % len(args.modes)
        for mode in args.modes[k:] + args.modes[:k]:
            runs.append(run_mode(out, mode, args.steps, args.override, round_, args.test_freq))
            r = runs[-1]
            print(
                f"round {round_} {mode}: {r['steps']} steps, median step "
                f"{r['median_step_s']:.2f}s, held-out greedy accuracy {r['acc_step0']:.3f} -> "
                f"{r['acc_final']:.3f}",
                flush=True,
            )
    summary = {}
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "median_step_s": statistics.median(r["median_step_s"] for r in mine),
            "round_median_step_s": [round(r["median_step_s"], 3) for r in mine],
            "acc_step0": mine[0]["acc_step0"],
            "acc_final_mean": statistics.mean(r["acc_final"] for r in mine),
            "acc_final_by_round": [r["acc_final"] for r in mine],
        }
    print("\n| mode | median s/step (rounds) | step-0 acc | final acc (rounds) |")
    print("|---|---|---|---|")
    for mode, m in summary.items():
        rounds = ", ".join(f"{v:.2f}" for v in m["round_median_step_s"])
        finals = ", ".join(f"{v:.3f}" for v in m["acc_final_by_round"])
        print(
            f"| {mode} | {m['median_step_s']:.2f} ({rounds}) | {m['acc_step0']:.3f} | "
            f"{m['acc_final_mean']:.3f} ({finals}) |"
        )
    result = {
        "benchmark": "learning_cpu_async_modes",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "summary": summary,
        "runs": runs,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.results}")
    return result


if __name__ == "__main__":
    main()
