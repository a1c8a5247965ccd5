"""GSM8k: the final number of the response against the ground truth, verl's semantics.

- ``strict``: the number after the last ``####`` (verl's format: the model must write it);
- ``flexible``: the last number anywhere in the response.

Commas and ``$`` are stripped, and a sentence's final period (``#### 72.``); then the strings
must be equal (``"72"`` vs ``"72.0"`` is wrong, as in verl). An extracted but wrong answer
scores ``format_score``; no answer at all scores 0. Unlike verl, the whole response is
searched (verl looks at its last 300 characters only).
"""

from __future__ import annotations

import re
from typing import Any

# Written so that no input backtracks quadratically: ``\s*\$?\s*`` and a number allowed to
# start inside a run of dots took seconds on a 10k-character run of spaces or dots (a
# degenerate response), i.e. the whole sample timeout. Same matches as the obvious forms.
_STRICT = re.compile(r"####\s*(?:\$\s*)?(-?[0-9][0-9.,]*|-?\.[0-9][0-9.,]*)")
_NUMBER = re.compile(r"-?(?<![0-9.,])[0-9.,]*[0-9][0-9.,]*")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer the response gives, cleaned; None when there is none."""
    if method == "strict":
        found = _STRICT.findall(solution_str)
    elif method == "flexible":
        found = _NUMBER.findall(solution_str)
    else:
        raise ValueError(f"method must be strict or flexible, got {method!r}")
    for candidate in reversed(found):
        cleaned = _clean(candidate)
        if cleaned not in ("", "-"):
            return cleaned
    return None


def read_answer(solution_str: str, extra_info: dict[str, Any] | None = None) -> str | None:
    """The answer :func:`compute_score` judges with its default method."""
    return extract_answer(solution_str, "strict")


def compute_score(
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == _clean(ground_truth.strip()) else format_score
