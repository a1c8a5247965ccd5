"""MATH (Hendrycks): the per-problem JSON tree ``MATH/<split>/<subject>/<n>.json``, MATH-500's
``test.jsonl``, or the hub's parquet exports (DigitalLearningGmbH/MATH-lighteval). The problem
plus verl's instruction; ground truth = the last ``\\boxed{}`` of the reference solution.

As verl's ``math_dataset.py`` writes them (it maps the hub's rows, popping only ``problem``
and ``solution``), ``level`` and ``type`` stay top-level columns; ``extra_info`` has them too.
MATH-500's records (they carry a ``unique_id``) are 500 of the full test set's 5000
problems: they go to ``math500.parquet``, data_source ``HuggingFaceH4/MATH-500``, never into
``test.parquet``, where a folder holding both would count those 500 twice."""

from __future__ import annotations

from typing import Any

from meshrl.data.boxed import last_boxed
from meshrl.data.preprocess.common import user_prompt

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH500_DATA_SOURCE = "HuggingFaceH4/MATH-500"
MATH500_SPLIT = "math500"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SPLIT_MAP = {"train": "train", "test": "test"}


def is_math500(rec: dict[str, Any]) -> bool:
    """MATH-500's records name their problem in the full set (``test/algebra/9.json``)."""
    return bool(rec.get("unique_id"))


def output_split(rec: dict[str, Any], split: str) -> str:
    """MATH-500's records get a file of their own (see the module's docstring)."""
    return MATH500_SPLIT if is_math500(rec) else split


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    problem, solution = rec.get("problem"), rec.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str):
        return "no problem/solution field"
    gt = last_boxed(solution)
    if gt is None:
        return "solution without \\boxed{}"
    level = rec.get("level")
    # "Level 3" in the JSON tree, 3 in MATH-500: one type per parquet column.
    level = level if isinstance(level, str) or level is None else f"Level {level}"
    kind = rec.get("type") or rec.get("subject")
    extra = {"split": split, "index": index, "level": level, "type": kind}
    if is_math500(rec):
        extra["unique_id"] = rec["unique_id"]
    return {
        "data_source": MATH500_DATA_SOURCE if is_math500(rec) else DATA_SOURCE,
        "prompt": user_prompt(problem + " " + INSTRUCTION),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": extra,
        "level": level,
        "type": kind,
    }
