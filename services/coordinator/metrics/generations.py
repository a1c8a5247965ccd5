"""Generations written out for reading (verl's ``trainer.rollout_data_dir`` and
``trainer.validation_data_dir``): ``<dir>/<step>.jsonl``, one sample a line, with the
prompt, the response, its ground truth and score and the reward's extras, so a user sees
what the model writes and how it was judged without a debugger; a sample the reward service
could not score says why, so a scorer's failure is not read as a wrong answer. Also the
few validation samples the loggers show as tables (``trainer.log_val_generations``)."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import NamedTuple

from services.reward.types import ScoreItem


def generations_dir(configured: str | None, run_dir: Path) -> Path | None:
    """The folder to write to; a relative path is under the run folder. None: off."""
    if not configured:
        return None
    path = Path(configured)
    return path if path.is_absolute() else Path(run_dir) / path


def write_generations(
    folder: Path,
    step: int,
    items: list[ScoreItem],
    scores: list[float],
    extras: list[dict[str, float]],
    reward_failures: list[str] | None = None,
) -> Path:
    """Writes ``<folder>/<step>.jsonl`` (whole, then renamed: a reader never sees half a
    file) and returns its path. ``items``: the samples as the reward service got them
    (``GeneratedBatch.reward_items``: prompt, response, ground_truth); ``reward_failures``:
    why the reward service could not score each sample, "" when it did (None: all scored).
    Lines: input, output, gts, score, step, ``reward_failure`` (only for a sample that was
    not scored: its score 0 is no verdict on the answer), then the extras."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    tmp = folder / f".{step}.jsonl.tmp"
    failures = reward_failures if reward_failures is not None else [""] * len(items)
    rows = zip(items, scores, extras, failures, strict=True)
    try:
        with tmp.open("w", encoding="utf-8") as f:  # the texts as written, whatever the locale
            for item, score, extra, failure in rows:
                line: dict[str, object] = {"input": item.prompt, "output": item.response}
                line.update(gts=item.ground_truth, score=score, step=step)
                if failure:
                    line["reward_failure"] = failure
                line.update({k: v for k, v in extra.items() if math.isfinite(v) and k not in line})
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure; gone already after the rename
    return path


class GenerationRow(NamedTuple):
    """One validation sample as the loggers show it (trainer.log_val_generations)."""

    input: str
    output: str
    score: float


def pick_shown(rows: list[GenerationRow], count: int, seed: int) -> list[GenerationRow]:
    """``count`` of a validation's rows, the same prompts at every validation (verl's way:
    sorted by input, shuffled with a fixed seed, the first ``count``), so a logger's table
    follows the same samples as training goes on."""
    ordered = sorted(rows, key=lambda row: row.input)
    random.Random(seed).shuffle(ordered)
    return ordered[:count]
