"""The last line of `meshrl run`: how the run ended, at which step, and what its folder holds.

Only what is there: `metrics.jsonl` is written by the `jsonl` logger alone (verl's
`trainer.logger=console` writes none), `metrics.png` only from it, and a checkpoint only
with `trainer.save_freq` (or at a stop). Before, `(metrics.jsonl, checkpoints/)` was printed
whatever the folder held.
"""

from __future__ import annotations

from pathlib import Path

from meshrl_app.run_local import RunResult
from services.coordinator.recovery.checkpointing import CheckpointManager


def ended_line(result: RunResult, run_dir: Path) -> str:
    """``meshrl: run finished at step 10 of 10; run folder runs/x (metrics.jsonl,
    metrics.png, checkpoints/global_step_10)``; a run that trained nothing says why, once."""
    if result.note and result.finished:  # a finished run run again
        what = result.note
    elif result.note:
        what = f"run {result.note}"  # "stopped before the first step"
    else:
        ended = "finished" if result.finished else "stopped"
        at = f" at step {result.step} of {result.total_steps}" if result.total_steps else ""
        what = f"run {ended}{at}"
    return f"meshrl: {what}; run folder {run_dir} ({folder_contents(run_dir)})"


def folder_contents(run_dir: Path) -> str:
    """What a user looks for in a run folder, as far as it is there: "metrics.jsonl,
    metrics.png, checkpoints/global_step_4" (the newest complete checkpoint)."""
    run_dir = Path(run_dir)
    kept = [name for name in ("metrics.jsonl", "metrics.png") if (run_dir / name).is_file()]
    checkpoints = CheckpointManager(run_dir).complete()
    if checkpoints:
        kept.append(str(checkpoints[-1].relative_to(run_dir)))
    if not kept:
        return "no metrics.jsonl, no checkpoint"
    return ", ".join(kept)
