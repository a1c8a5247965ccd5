"""`meshrl demo`: make the data and the warm-started tiny model, then a real PPO run through
the gRPC mesh (every role its own process), then a summary and a plot."""

from __future__ import annotations

import shutil
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.config import ConfigError, load_config
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import read_problems, write_arithmetic_parquet
from meshrl_app.demo.warm_start import warm_start
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import step_of

DIGITS = 2
"""Operand size of the demo's addition problems."""
WARM_START_STOP_AT = 0.2
"""The warm start stops at the first check (every 10 iterations) where greedy accuracy on
128 training problems reaches this: a weak start that leaves PPO room (docs/learning.md)."""
WARM_START_MAX_ITERATIONS = 2000


def prepare_model(out_dir: Path, held_out: set, seed: int = 0) -> Path:
    """Builds the tiny model from a config, warm-starts it, saves it as a HF folder. A
    folder warm-started before with the same seed is kept."""
    model_dir = out_dir / "model"
    marker = model_dir / "WARM_STARTED"
    if marker.exists() and marker.read_text().startswith(f"seed {seed},"):
        return model_dir
    print(f"demo: building the tiny model in {model_dir}", flush=True)
    make_tiny_model_dir(model_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    start = time.perf_counter()
    print(
        f"warm start: supervised training until greedy accuracy on training problems reaches "
        f"{WARM_START_STOP_AT:.2f} (at most {WARM_START_MAX_ITERATIONS} iterations)",
        flush=True,
    )
    done = warm_start(
        model,
        tokenizer,
        max_iterations=WARM_START_MAX_ITERATIONS,
        stop_at_accuracy=WARM_START_STOP_AT,
        seed=seed,
        held_out=held_out,
        digits=DIGITS,
        report=lambda line: print(line, flush=True),
    )
    print(
        f"warm start: {done.iterations} iterations in {time.perf_counter() - start:.0f}s, "
        f"loss {done.losses[0]:.3f} -> {done.losses[-1]:.3f}, greedy accuracy on "
        f"training problems {done.probe_accuracy:.2f}"
    )
    model.save_pretrained(model_dir)
    (model_dir / "WARM_STARTED").write_text(f"seed {seed}, {done.iterations} iterations\n")
    return model_dir


def demo_config(out_dir: Path, overrides: list[str], config_path: str | None = None):
    """The demo's config (or another one, e.g. examples/grpo_n4.yaml) with the demo's paths.
    Read by `meshrl run`'s loader, so a missing or malformed file is the same ConfigError."""
    data = out_dir / "data"
    paths = {s: data / f"{s}.parquet" for s in ("train", "test")}
    base = [
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        f"actor_rollout_ref.model.path={out_dir / 'model'}",
        f"trainer.default_local_dir={out_dir / 'run'}",
    ]
    if config_path is not None:
        return load_config(config_path, base + list(overrides))
    with resources.as_file(resources.files("meshrl_app.demo").joinpath("demo.yaml")) as path:
        return load_config(path, base + list(overrides))


def _scores_by_step(rows: list[dict]) -> list[float]:
    """`critic/score/mean` of each step in step order; a step run again after a rewind is
    logged again, and its later line counts (docs/checkpoints.md)."""
    by_step = {r["step"]: r["critic/score/mean"] for r in rows if "critic/score/mean" in r}
    return [by_step[s] for s in sorted(by_step)]


def held_out_accuracy(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, greedy held-out accuracy) of each validation in step order: the first
    `val-core/<data_source>/acc/mean@1` of a line; a validation logged again after a rewind
    counts with its later line."""
    by_step = {}
    for r in rows:
        accs = [v for k, v in r.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1")]
        if accs:
            by_step[r["step"]] = accs[0]
    return sorted(by_step.items())


def summarize(run_dir: Path) -> float:
    """Prints the run's score rise, held-out greedy accuracy at each validation and at the
    first and last, and where its files are; returns the score rise."""
    metrics_file = run_dir / "metrics.jsonl"
    # absent when trainer.logger leaves out jsonl
    rows = read_jsonl(metrics_file) if metrics_file.is_file() else []
    scores = _scores_by_step(rows)
    if not scores:
        print(f"\nno training steps logged in {metrics_file}")
        return 0.0
    n = min(5, len(scores))  # a short run (e.g. total_training_steps=3) averages what it has
    first, last = sum(scores[:n]) / n, sum(scores[-n:]) / n
    print(
        f"\nscore: first {n} steps {first:.3f} -> last {n} steps {last:.3f} "
        f"(rise {last - first:+.3f})"
    )
    val = held_out_accuracy(rows)
    if val:
        print("greedy validation accuracy by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in val))
    print(f"metrics: {metrics_file}\nplot:    {run_dir / 'metrics.png'}")
    saved = sorted((run_dir / "checkpoints").glob("global_step_*"), key=step_of)
    if saved:  # `meshrl export` makes a Hugging Face folder of it
        print(f"model:   {saved[-1]} (meshrl export {saved[-1]} --to <folder>)")
    if val:  # last, the figure the demo is for
        (s0, a0), (s1, a1) = val[0], val[-1]
        print(
            f"\nheld-out greedy accuracy (problems never trained on, temperature 0): "
            f"step {s0} {a0:.3f} -> step {s1} {a1:.3f} ({a1 - a0:+.3f})"
        )
    return last - first


def clear_run_dir(run_dir: Path, out: Path) -> None:
    """A fresh run each time (no resume, metrics of this run only). Only the demo's own
    folders are removed: a run folder given elsewhere (trainer.default_local_dir=...) may
    hold another run's checkpoints, so it must be new or empty."""
    run_dir = run_dir.resolve()
    if run_dir.is_relative_to(out) and run_dir != out:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"trainer.default_local_dir={run_dir} is not empty: the demo starts a fresh run "
            f"and removes only run folders under --out ({out}); give a new or empty folder"
        )


def run_demo(
    out_dir: str = "demo_out", overrides: list[str] | None = None, config_path: str | None = None
) -> int:
    from meshrl_app.run_local import run_local

    # One thread: the tiny model's small matmuls gain little from a second, and lose about 10x
    # when another process keeps the other core busy (a 60-iteration warm start: 4 s on one
    # thread, 43 s on two, with the machine shared).
    torch.set_num_threads(1)
    out = Path(out_dir).resolve()
    cfg = demo_config(out, overrides or [], config_path)
    clear_run_dir(Path(cfg.trainer.default_local_dir), out)
    print(f"demo: writing the addition problems to {out / 'data'}", flush=True)
    data = write_arithmetic_parquet(out / "data", digits=DIGITS)
    prepare_model(out, read_problems(data["test"]), seed=cfg.trainer.seed)
    start = time.perf_counter()
    run_local(cfg)
    print(f"PPO run: {time.perf_counter() - start:.0f}s (role servers' start-up included)")
    summarize(Path(cfg.trainer.default_local_dir))
    return 0
