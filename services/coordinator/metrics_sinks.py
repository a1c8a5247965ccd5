"""Where step metrics go: the console (one line per step) and a JSONL file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

CONSOLE_KEYS = [
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/reward_kl_penalty", "kl"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": k, "<metric>": value, ...}; appends on resume."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """A short line per step with the numbers one watches; validation lines in full."""

    def __init__(self, write=print):
        self.write = write

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
        parts += [f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("val-core/")]
        self.write(f"step {step}: " + " ".join(parts))

    def close(self) -> None:
        pass


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
