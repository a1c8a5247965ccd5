"""HellaSwag (rowanz/hellaswag ``hellaswag_{train,val}.jsonl`` or the hub's Rowan/hellaswag
parquet): a generative multiple-choice prompt listing the four endings as A-D; ground truth =
the label index as a string. The unlabeled test split is skipped; validation becomes test.

The context is verl's: ``activity_label + ": " + ctx_a + " " + ctx_b.capitalize()``, with
WikiHow's markup cleaned the way verl (and lm-eval-harness) clean it.
"""

from __future__ import annotations

import re
from typing import Any

from meshrl.data.preprocess.common import user_prompt

DATA_SOURCE = "Rowan/hellaswag"
LETTERS = "ABCD"
SPLIT_MAP = {"train": "train", "validation": "test", "test": "test"}
QUESTION = "Which ending is the most plausible continuation?"
ANSWER_HINT = "Answer with the letter of the correct ending."


def clean(text: str) -> str:
    """`` [title]`` becomes a sentence break, other ``[...]`` tags go, double spaces fold."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def context(rec: dict[str, Any]) -> str:
    if rec.get("ctx_a") is not None:
        ctx = rec["ctx_a"] + " " + (rec.get("ctx_b") or "").capitalize()
    else:
        ctx = rec.get("ctx") or ""
    label = rec.get("activity_label")
    return clean(f"{label}: {ctx}" if label else ctx)


def render(ctx: str, endings: list[str]) -> str:
    options = "\n".join(f"{LETTERS[i]}. {e}" for i, e in enumerate(endings))
    return f"{ctx}\n\n{QUESTION}\n{options}\n\n{ANSWER_HINT}"


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    endings = rec.get("endings")
    if not isinstance(endings, list) or len(endings) != 4:
        return "endings is not a list of 4"
    label = rec.get("label")
    if label is None or str(label).strip() == "":
        return "no label (unlabeled test split)"
    endings = [clean(e) for e in endings]
    return {
        "data_source": DATA_SOURCE,
        "prompt": user_prompt(render(context(rec), endings)),
        "ability": "nlp",
        "reward_model": {"style": "rule", "ground_truth": str(int(label))},
        "extra_info": {
            "split": split,
            "index": index,
            "endings": endings,
            "activity_label": str(rec.get("activity_label") or ""),
            "source_id": str(rec.get("source_id") or ""),
        },
    }
