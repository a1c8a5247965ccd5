"""GSM8k (openai/grade-school-math ``train.jsonl``/``test.jsonl``, or the hub's parquet
exports): the question plus verl's instruction; ground truth = the number after ``####``."""

from __future__ import annotations

from typing import Any

from meshrl.data.preprocess.common import user_prompt

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLIT_MAP = {"train": "train", "test": "test"}


def answer_number(answer: str) -> str | None:
    """``"... she makes $18.\\n#### 1,018"`` -> ``"1018"``; None without ``####``."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    question, answer = rec.get("question"), rec.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        return "no question/answer field"
    gt = answer_number(answer)
    if gt is None:
        return "answer without ####"
    return {
        "data_source": DATA_SOURCE,
        "prompt": user_prompt(question + " " + INSTRUCTION),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }
