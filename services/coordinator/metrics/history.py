"""A run's latest history from its metrics.jsonl, where a recovery or a resume went back.

metrics.jsonl is appended to, never rewritten: a run that went back to its checkpoint at
step 40 after logging step 45 logs steps 41, 42, ... again (45, 41, 42 in the file), and a
run resumed from an older checkpoint does the same. Read in order, a line of step k ends
the history after k (the steps beyond it were abandoned). A line of a step already held
replaces it when they share a metric (the step was run again), and joins it when they do
not (a step's training line and its validation line, logged apart).
"""

from __future__ import annotations

from pathlib import Path

from services.coordinator.metrics.sinks import read_jsonl


def latest_history(rows: list[dict]) -> list[dict]:
    """One row per step of the history that the last line continues, in step order."""
    steps: dict[int, dict] = {}  # step -> its merged row; keys kept in increasing order
    for row in rows:
        step = row["step"]
        for later in [s for s in steps if s > step]:  # abandoned by a rewind
            del steps[later]
        held = steps.get(step, {})
        run_again = any(key != "step" and key in held for key in row)
        steps[step] = dict(row) if run_again else {**held, **row}
    return list(steps.values())


def read_history(path: Path) -> list[dict]:
    """``latest_history`` of the metrics file at ``path``."""
    return latest_history(read_jsonl(path))
