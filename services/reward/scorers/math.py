"""MATH: the last ``\\boxed{...}`` of the response, checked for equivalence by math-verify.

Only extraction is ours (balanced braces, ``meshrl.data.boxed``); equivalence is math-verify's
``parse`` + ``verify`` (``\\boxed{\\frac{1}{2}}`` equals ``0.5``). Both sides are wrapped in
``\\boxed{}`` so math-verify reads them the same way.

Guards against a pathological answer (``9^{9^{9^{9}}}``, thousands of nested braces):
math-verify's own SIGALRM timeouts (parse and verify, each a few seconds, so a slow sample
usually ends here and its worker survives) and an answer-length cap; the worker pool's
per-sample timeout is the backstop for work no signal can interrupt (a huge power computed in
C), where the worker is killed.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from math_verify import parse, verify

from meshrl.data.boxed import last_boxed

PARSE_TIMEOUT_S = 3
VERIFY_TIMEOUT_S = 3
MAX_ANSWER_CHARS = 1000
"""A boxed answer longer than this is not a final answer; scored 0 without parsing."""

# math-verify logs every timed-out expression in full at WARNING.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def extract_answer(solution_str: str) -> str | None:
    return last_boxed(solution_str)


def read_answer(solution_str: str, extra_info: dict[str, Any] | None = None) -> str | None:
    """The boxed answer :func:`compute_score` judges, stripped; None when there is none."""
    answer = extract_answer(solution_str)
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer.strip()


def compute_score(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    answer = read_answer(solution_str)
    if answer is None:
        return 0.0
    gold = last_boxed(ground_truth) or ground_truth  # a ground truth may come boxed
    return 1.0 if equivalent(gold.strip(), answer) else 0.0


@lru_cache(maxsize=16384)
def equivalent(gold: str, answer: str) -> bool:
    """math-verify's verdict on two boxed contents. Cached per worker: the n samples of one
    prompt often box the same answer."""
    if gold == answer:  # what math-verify would say too, without parsing
        return True
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=PARSE_TIMEOUT_S)
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=PARSE_TIMEOUT_S)
    if not gold_parsed or not pred_parsed:
        return False
    return verify(gold_parsed, pred_parsed, timeout_seconds=VERIFY_TIMEOUT_S)
