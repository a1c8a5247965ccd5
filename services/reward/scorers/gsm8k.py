"""GSM8k: the final number of the response against the ground truth.

Three ways to read the answer (``method``; ``reward.gsm8k_method`` picks the run's):

- ``strict`` (the default, verl's ``verl/utils/reward_score/gsm8k.py``): the number in the
  last ``#### N`` (exactly one space after ``####``) of the response's last 300
  characters, commas removed. ``#### $18``, ``####18``, ``####\\n18`` and an answer
  before the last 300 characters give nothing, and ``#### 72.`` reads ``72.``: all score 0
  against ``72``, as in verl.
- ``flexible`` (verl's): the last number in the last 300 characters, as written (``1,234``
  stays ``1,234``; a lone ``.`` is skipped).
- ``lenient`` (meshrl's own): the number after the last ``####`` anywhere in the
  response, spaces, a newline or a ``$`` allowed between them; commas, ``$`` and a
  sentence's final period removed, from the ground truth too.

Then the strings must be equal (``"72"`` vs ``"72.0"`` is wrong, as in verl). An extracted
but wrong answer scores ``format_score``; no answer at all scores 0.
"""

from __future__ import annotations

import re
from typing import Any

METHODS = ("strict", "flexible", "lenient")

CLIP_CHARS = 300
"""verl's ``_SOLUTION_CLIP_CHARS``: strict and flexible read only the response's end."""

_VERL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_VERL_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
# Written so that no input backtracks quadratically: lenient reads the whole response, and
# ``\s*\$?\s*`` or a number allowed to start inside a run of dots took seconds on a
# 10k-character run of spaces or dots (a degenerate response), the whole sample timeout.
_LENIENT = re.compile(r"####\s*(?:\$\s*)?(-?[0-9][0-9.,]*|-?\.[0-9][0-9.,]*)")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer the response gives, read by `method`; None when there is none."""
    if method == "strict":
        found = _VERL_STRICT.findall(solution_str[-CLIP_CHARS:])
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        numbers = [n for n in _VERL_NUMBER.findall(solution_str[-CLIP_CHARS:]) if n != "."]
        return numbers[-1] if numbers else None
    if method == "lenient":
        for candidate in reversed(_LENIENT.findall(solution_str)):
            cleaned = _clean(candidate)
            if cleaned not in ("", "-"):
                return cleaned
        return None
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def read_answer(
    solution_str: str, extra_info: dict[str, Any] | None = None, *, method: str = "strict"
) -> str | None:
    """The answer :func:`compute_score` judges with the same `method`."""
    return extract_answer(solution_str, method)


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
    if method == "lenient":
        ground_truth = _clean(ground_truth.strip())
    return score if answer == ground_truth else format_score
