"""How long the local launcher takes to bring a run's role servers up, forked against spawned.

    .venv/bin/python -m benchmarks.system.server_startup [--rounds 3]

Each round measures both ``launcher.start_method`` values (which goes first alternates),
each in a fresh Python process, as ``meshrl run`` starts: the five role servers of a GAE
run with a reference (rollout, actor, critic, ref, reward) on the tiny test model. Per
start method and round it times

- ``start_s``: ``LocalLauncher.start()`` until every server answers its health check (for
  ``forkserver`` this includes starting the fork server, once per process);
- ``init_s``: ``PPORun.setup()``: each server's Initialize (model load, FSDP wrap, the
  first weight sync);
- ``restart_s``: ``launcher.restart("actor")``, as after a crash;
- ``second_start_s``: a second ``start()`` in the same process (the coordinator service's
  next run; a test session's next mesh);
- ``stop_s``: ``LocalLauncher.stop()``.

Prints the medians and the spawn / forkserver ratios and writes
``benchmarks/results/system_server_startup_cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parents[1] / "results" / "system_server_startup_cpu.json"
METHODS = ("spawn", "forkserver")
FIGURES = ("start_s", "init_s", "restart_s", "second_start_s", "stop_s")


def measure(method: str) -> dict:
    """One process's figures (run in a fresh interpreter by ``main``)."""
    from meshrl.config import build_config
    from meshrl.launcher.local import LocalLauncher
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app.demo.arithmetic import write_arithmetic_parquet
    from services.coordinator.run.run import PPORun

    root = Path(tempfile.mkdtemp(prefix="startup-"))
    model = make_tiny_model_dir(root / "tiny", seed=0, hidden=32, intermediate=64)
    data = write_arithmetic_parquet(root / "data", n_train=16, n_val=8)
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{data['train']}]",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=4",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            f"launcher.start_method={method}",
        ],
    )
    out = {}
    with LocalLauncher(cfg, root / "a") as launcher:
        t = time.perf_counter()
        endpoints = launcher.start()
        out["start_s"] = time.perf_counter() - t
        run = PPORun(cfg, endpoints, root / "a", restarter=launcher)
        t = time.perf_counter()
        run.setup()
        out["init_s"] = time.perf_counter() - t
        run.close()
        t = time.perf_counter()
        launcher.restart("actor")
        out["restart_s"] = time.perf_counter() - t
        t = time.perf_counter()
    out["stop_s"] = time.perf_counter() - t
    with LocalLauncher(cfg, root / "b") as launcher:
        t = time.perf_counter()
        launcher.start()
        out["second_start_s"] = time.perf_counter() - t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    rounds = []
    for r in range(args.rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        figures = {}
        for method in order:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.system.server_startup", "--child", method],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            figures[method] = json.loads(done.stdout.strip().splitlines()[-1])
        rounds.append(figures)
        print(f"round {r + 1}: " + json.dumps(figures))
    median = {
        m: {f: round(statistics.median(r[m][f] for r in rounds), 3) for f in FIGURES}
        for m in METHODS
    }
    ratio = {
        f: round(statistics.median(r["spawn"][f] / r["forkserver"][f] for r in rounds), 2)
        for f in FIGURES
    }
    print(f"{'figure':<16}{'spawn':>10}{'forkserver':>12}{'spawn/fork':>12}")
    for f in FIGURES:
        print(
            f"{f:<16}{median['spawn'][f]:>10.2f}{median['forkserver'][f]:>12.2f}{ratio[f]:>11.2f}x"
        )
    result = {
        "command": "python -m benchmarks.system.server_startup --rounds " + str(args.rounds),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "median": median,
        "ratio_spawn_over_forkserver": ratio,
        "rounds": rounds,
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
