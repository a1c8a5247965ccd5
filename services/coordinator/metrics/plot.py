"""A PNG of score, KL and response length per step, from the run's metrics JSONL.

It draws the run's latest history (``metrics_history``): after a recovery or a resume that
went back, the steps run again replace the abandoned ones, instead of a line drawn back
from step 45 to step 41.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402

from services.coordinator.metrics.history import read_history  # noqa: E402

PANELS = [
    ("critic/score/mean", "score (mean)"),
    ("actor/reward_kl_penalty", "KL to reference"),
    ("actor/ppo_kl", "PPO KL (old vs new)"),
    ("response_length/mean", "response length (tokens)"),
]


def plot_metrics(jsonl_path: Path, png_path: Path) -> Path | None:
    """Writes the PNG; None (and no file) when no step has been logged yet, as in a run
    that failed before its first step."""
    history = read_history(jsonl_path)  # one row per step, steps increasing
    rows = [r for r in history if "critic/score/mean" in r]
    panels = [(k, t) for k, t in PANELS if any(r.get(k) is not None for r in rows)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    val = [
        (r["step"], v)
        for r in history
        for k, v in r.items()
        if k.startswith("val-core/") and "/acc/" in k and v is not None
    ]
    if val:
        axes[0][0].plot([p[0] for p in val], [p[1] for p in val], "o--", label="val acc")
        axes[0][0].legend()
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
