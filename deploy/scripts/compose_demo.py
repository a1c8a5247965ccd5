#!/usr/bin/env python3
"""The compose demo: prepare the demo's data and warm-started model in the shared volumes,
then submit the run to the coordinator container and follow it (`meshrl run --coordinator`).

    meshrl-compose-demo [prepare|submit|all] [key=value ...]

Installed in the images as `meshrl-compose-demo`; the `demo` service of deploy/compose.yaml
runs it. The role servers are the other containers (launcher.kind=external), found on the
host network at the ports below. Extra `key=value` overrides (or MESHRL_DEMO_OVERRIDES)
go to the run, e.g. `trainer.total_training_steps=3`.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

# Role -> (environment variable of its port, default port); compose.yaml uses the same.
PORTS = {
    "rollout": ("MESHRL_ROLLOUT_PORT", 50051),
    "actor": ("MESHRL_ACTOR_PORT", 50052),
    "critic": ("MESHRL_CRITIC_PORT", 50053),
    "ref": ("MESHRL_REF_PORT", 50054),
    "reward": ("MESHRL_REWARD_PORT", 50055),
}
MODELS = Path(os.environ.get("MESHRL_MODELS_DIR", "/models"))
DATA = Path(os.environ.get("MESHRL_DATA_DIR", "/data"))
CHECKPOINTS = Path(os.environ.get("MESHRL_CHECKPOINTS_DIR", "/checkpoints"))


def addresses() -> dict[str, list[str]]:
    host = os.environ.get("MESHRL_HOST", "127.0.0.1")
    return {
        role: [f"{host}:{os.environ.get(var, default)}"] for role, (var, default) in PORTS.items()
    }


def config_path() -> Path:
    return DATA / "demo" / "run.yaml"


def prepare() -> Path:
    """Data, model and the run config; idempotent (a finished model is kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrl.config import config_to_yaml
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app.demo.arithmetic import read_problems, write_arithmetic_parquet
    from meshrl_app.demo.run import (
        DIGITS,
        WARM_START_MAX_ITERATIONS,
        WARM_START_STOP_AT,
        demo_config,
    )
    from meshrl_app.demo.warm_start import warm_start

    # at most this many warm-start iterations; it stops earlier, as `meshrl demo`'s, at
    # WARM_START_STOP_AT greedy accuracy on training problems
    iterations = int(os.environ.get("MESHRL_DEMO_WARM_START", WARM_START_MAX_ITERATIONS))
    paths = write_arithmetic_parquet(DATA / "demo", digits=DIGITS)
    model_dir = MODELS / "demo"
    if not (model_dir / "WARM_STARTED").exists():
        held_out = read_problems(paths["test"])
        make_tiny_model_dir(model_dir, seed=1)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        if iterations > 0:  # 0: a random model (smoke tests only: it earns no reward)
            start = time.perf_counter()
            done = warm_start(
                model,
                tokenizer,
                max_iterations=iterations,
                stop_at_accuracy=WARM_START_STOP_AT,
                seed=1,
                held_out=held_out,
                digits=DIGITS,
            )
            print(
                f"warm start: {done.iterations} iterations in {time.perf_counter() - start:.0f}s",
                flush=True,
            )
        model.save_pretrained(model_dir)
        (model_dir / "WARM_STARTED").write_text(f"{iterations}\n")
    cfg = demo_config(
        DATA / "demo",
        [
            f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]",
            f"actor_rollout_ref.model.path={model_dir}",
            f"trainer.default_local_dir={CHECKPOINTS / 'demo'}",
            "launcher.kind=external",
        ],
    )
    cfg.launcher.addresses = addresses()
    config_path().write_text(config_to_yaml(cfg))
    print(
        f"demo prepared: model {model_dir}, data {DATA / 'demo'}, config {config_path()}",
        flush=True,
    )
    return config_path()


def submit(overrides: list[str]) -> int:
    from meshrl_app.cli import main

    coordinator = os.environ.get("MESHRL_COORDINATOR", "127.0.0.1:50050")
    extra = shlex.split(os.environ.get("MESHRL_DEMO_OVERRIDES", ""))
    return main(["run", "--coordinator", coordinator, str(config_path()), *extra, *overrides])


def main(argv: list[str]) -> int:
    action = argv[0] if argv and "=" not in argv[0] else "all"
    overrides = argv[1:] if argv and "=" not in argv[0] else argv
    if action in ("prepare", "all"):
        prepare()
    if action in ("submit", "all"):
        return submit(overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
