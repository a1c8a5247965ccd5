"""`meshrl demo`: make the data and the warm-started tiny model, then a real PPO run through
the gRPC mesh (every role its own process), then a summary and a plot."""

from __future__ import annotations

import shutil
import time
from importlib import resources
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.config import build_config
from meshrl.demo.arithmetic import write_arithmetic_parquet
from meshrl.demo.warm_start import warm_start
from meshrl.testing.tiny_model import make_tiny_model_dir
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
    """The demo's config (or another one, e.g. examples/grpo_n4.yaml) with the demo's paths."""
    text = (
        Path(config_path).read_text()
        if config_path
        else resources.files("meshrl.demo").joinpath("demo.yaml").read_text()
    )
    tree = yaml.safe_load(text)
    data = out_dir / "data"
    paths = {s: data / f"{s}.parquet" for s in ("train", "test")}
    base = [
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        f"actor_rollout_ref.model.path={out_dir / 'model'}",
        f"trainer.default_local_dir={out_dir / 'run'}",
    ]
    return build_config(tree, base + list(overrides))


def summarize(run_dir: Path) -> float:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    scores = [r["critic/score/mean"] for r in rows]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    val = [
        (r["step"], v)
        for r in read_jsonl(run_dir / "metrics.jsonl")
        for k, v in r.items()
        if k.startswith("val-core/") and "/acc/" in k
    ]
    print(
        f"\nscore: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (rise {last - first:+.3f})"
    )
    if val:
        print("greedy validation accuracy by step: " + ", ".join(f"{s}: {v:.2f}" for s, v in val))
    print(f"metrics: {run_dir / 'metrics.jsonl'}\nplot:    {run_dir / 'metrics.png'}")
    return last - first


def run_demo(
    out_dir: str = "demo_out", overrides: list[str] | None = None, config_path: str | None = None
) -> int:
    from meshrl.launcher.run_local import run_local

    torch.set_num_threads(2)
    out = Path(out_dir).resolve()
    cfg = demo_config(out, overrides or [], config_path)
    shutil.rmtree(cfg.trainer.default_local_dir, ignore_errors=True)  # a fresh run each time
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
