"""HellaSwag, generative: did the response pick the right ending?

The pick is read, in this order, as:
1. the whole response (punctuation aside) being a letter A-D or an index 0-3;
2. the last "answer is (C)" / "Answer: C" / "answer: 2" (but "answer is a man ..." is the
   article "a", not option A);
3. the last option marker "(C)" or a line starting "C." / "C)";
4. the ending text itself: of the row's endings (``extra_info["endings"]`` or ``["choices"]``)
   found in the response, the one that ends last (ties: the longer).
Ground truth: the label index (``"0"``-``"3"``). 1.0 when the pick matches, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

LETTERS = "ABCD"
_ALONE = re.compile(r"^\W*([A-Da-d]|[0-3])\W*$")
# Each optional token carries its own trailing whitespace, and a marker's leading whitespace
# stays on its line: the obvious forms (``\s*(?:is|:)?\s*[:\-]?\s*``, ``^\s*``) backtrack
# polynomially, e.g. 55 s on "answer" + 400 spaces. Same matches.
# A lowercase "a" followed by a word on its line is the article ("the answer is a man ..."),
# not option A; the ending's text then decides.
_ANSWER_IS = re.compile(
    r"answer\s*(?:(?:is|:)\s*)?(?:[:\-]\s*)?(?:\(\s*)?(?!(?-i:a[^\S\n]+[a-z]))([A-D]|[0-3])\b",
    re.IGNORECASE,
)
_MARKER = re.compile(r"\(([A-D])\)|^[^\S\n]*([A-D])[.):]", re.MULTILINE)


def _index_of(token: str) -> int:
    return int(token) if token.isdigit() else LETTERS.index(token.upper())


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _by_text(response: str, endings: list[str]) -> int | None:
    text = _norm(response)
    best: tuple[int, int, int] | None = None  # (end position, length, index)
    for i, ending in enumerate(endings):
        e = _norm(ending)
        pos = text.rfind(e) if e else -1
        if pos >= 0:
            cand = (pos + len(e), len(e), i)
            best = cand if best is None or cand[:2] > best[:2] else best
    return None if best is None else best[2]


def extract_choice(response: str, endings: list[str] | None = None) -> int | None:
    """The ending index the response picks, or None."""
    m = _ALONE.match(response.strip())
    if m:
        return _index_of(m.group(1))
    found = _ANSWER_IS.findall(response)
    if found:
        return _index_of(found[-1])
    markers = [a or b for a, b in _MARKER.findall(response)]
    if markers:
        return _index_of(markers[-1])
    return _by_text(response, endings) if endings else None


def read_answer(solution_str: str, extra_info: dict[str, Any] | None = None) -> str | None:
    """The index of the ending the response picks, as text ("2"); None when it picks none."""
    extra_info = extra_info or {}
    endings = extra_info.get("endings") or extra_info.get("choices")
    choice = extract_choice(solution_str, list(endings) if endings else None)
    return None if choice is None else str(choice)


def compute_score(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    choice = read_answer(solution_str, extra_info)
    if choice is None:
        return 0.0
    return 1.0 if int(choice) == int(str(ground_truth).strip()) else 0.0
