"""MATH (Hendrycks): the per-problem JSON tree ``MATH/<split>/<subject>/<n>.json``, MATH-500's
``test.jsonl``, or the hub's parquet exports (DigitalLearningGmbH/MATH-lighteval). The problem
plus verl's instruction; ground truth = the last ``\\boxed{}`` of the reference solution."""

from __future__ import annotations

from typing import Any

from meshrl.data.boxed import last_boxed
from meshrl.data.preprocess.common import user_prompt

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLIT_MAP = {"train": "train", "test": "test"}


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    problem, solution = rec.get("problem"), rec.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str):
        return "no problem/solution field"
    gt = last_boxed(solution)
    if gt is None:
        return "solution without \\boxed{}"
    level = rec.get("level")
    extra = {
        "split": split,
        "index": index,
        # "Level 3" in the JSON tree, 3 in MATH-500: one type per parquet column.
        "level": level if isinstance(level, str) or level is None else f"Level {level}",
        "type": rec.get("type") or rec.get("subject"),
    }
    if rec.get("unique_id"):
        extra["unique_id"] = rec["unique_id"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": user_prompt(problem + " " + INSTRUCTION),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": extra,
    }
