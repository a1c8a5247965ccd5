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
from meshrl_app.demo.arithmetic import write_arithmetic_parquet
from meshrl_app.demo.warm_start import warm_start
from services.coordinator.checkpointing import step_of
from services.coordinator.metrics_sinks import read_jsonl

WARM_START_ITERATIONS = 900


def prepare_model(out_dir: Path, held_out: set, seed: int = 0) -> Path:
    """Builds the tiny model from a config, warm-starts it, saves it as a HF folder."""
    model_dir = out_dir / "model"
    if (model_dir / "WARM_STARTED").exists():
        return model_dir
    make_tiny_model_dir(model_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    start = time.perf_counter()
    curve = warm_start(
        model, tokenizer, iterations=WARM_START_ITERATIONS, seed=seed, held_out=held_out
    )
    print(
        f"warm start: {WARM_START_ITERATIONS} iterations in {time.perf_counter() - start:.0f}s, "
        f"loss {curve[0]:.3f} -> {curve[-1]:.3f}"
    )
    model.save_pretrained(model_dir)
    (model_dir / "WARM_STARTED").write_text("ok\n")
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


def summarize(run_dir: Path) -> float:
    metrics_file = run_dir / "metrics.jsonl"
    # absent when trainer.logger leaves out jsonl
    rows = read_jsonl(metrics_file) if metrics_file.is_file() else []
    scores = _scores_by_step(rows)
    if not scores:
        print(f"\nno training steps logged in {metrics_file}")
        return 0.0
    n = min(5, len(scores))  # a short run (e.g. total_training_steps=3) averages what it has
    first, last = sum(scores[:n]) / n, sum(scores[-n:]) / n
    val = [
        (r["step"], v)
        for r in rows
        for k, v in r.items()
        if k.startswith("val-core/") and "/acc/" in k
    ]
    print(
        f"\nscore: first {n} steps {first:.3f} -> last {n} steps {last:.3f} "
        f"(rise {last - first:+.3f})"
    )
    if val:
        print("greedy validation accuracy by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in val))
    print(f"metrics: {metrics_file}\nplot:    {run_dir / 'metrics.png'}")
    saved = sorted((run_dir / "checkpoints").glob("global_step_*"), key=step_of)
    if saved:  # `meshrl export` makes a Hugging Face folder of it
        print(f"model:   {saved[-1]} (meshrl export {saved[-1]} --to <folder>)")
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

    torch.set_num_threads(2)
    out = Path(out_dir).resolve()
    cfg = demo_config(out, overrides or [], config_path)
    clear_run_dir(Path(cfg.trainer.default_local_dir), out)
    data = write_arithmetic_parquet(out / "data")
    import pyarrow.parquet as pq

    held_out = {
        tuple(int(x) for x in r["content"][3:-1].split("+"))
        for p in pq.read_table(data["test"]).column("prompt").to_pylist()
        for r in p
    }
    prepare_model(out, held_out, seed=cfg.trainer.seed)
    start = time.perf_counter()
    run_local(cfg)
    print(f"PPO run: {time.perf_counter() - start:.0f}s")
    summarize(Path(cfg.trainer.default_local_dir))
    return 0
