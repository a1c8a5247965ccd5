"""Finding the final ``\\boxed{...}`` answer of a math text, braces balanced.

Shared by the MATH preprocessor (ground truth = last box of the reference solution) and the
MATH scorer (prediction = last box of the response).
"""

from __future__ import annotations

_OPENERS = ("\\boxed{", "\\fbox{", "\\boxed ")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, nested braces kept.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``. Also reads ``\\boxed 5`` (a box
    without braces, up to the next ``$``). None when there is no box or the last box is never
    closed.
    """
    start, opener = max((text.rfind(o), o) for o in _OPENERS)
    if start < 0:
        return None
    i = start + len(opener)
    if not opener.endswith("{"):
        return text[i:].split("$", 1)[0].strip() or None
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None
