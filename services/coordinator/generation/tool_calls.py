"""Tool calls in the model's text, in the Hermes format (Qwen2.5's chat template, verl's
default ``multi_turn.format``)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "48 / 2"}}
    </tool_call>

A turn ends with its first complete call (as a stop string would end it): what the model
sampled after it is dropped, never trained on, and the environment's answer comes next.
The cut is at a token boundary, found on the decoded text, so the kept tokens are exactly
the sampled ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from services.env.types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


def tokens_through_first_call(ids: Sequence[int], decode: Callable[[list[int]], str]) -> int:
    """How many of ``ids`` the turn keeps: up to and including the token that completes the
    first ``</tool_call>`` (all of them when no call closes). ``decode``: ids -> text."""
    text = decode(list(ids))
    match = _CALL.search(text)
    if match is None:
        return len(ids)
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a complete call
    while lo < hi:
        mid = (lo + hi) // 2
        if _CALL.search(decode(list(ids[:mid]))) is not None:
            hi = mid
        else:
            lo = mid + 1
    return lo


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str]:
    """The calls written in ``text`` and why one could not be read ("" when all could).

    A call is a JSON object with a string ``name`` and an ``arguments`` object (or a JSON
    string of one, as some models write it)."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return calls, f"the tool call is not JSON ({e.msg} at character {e.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls, 'a tool call needs a JSON object with a "name"'
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return calls, "the tool call's arguments are not a JSON object"
        if not isinstance(arguments, dict):
            return calls, "the tool call's arguments are not a JSON object"
        calls.append(ToolCall(obj["name"], arguments))
    if not calls and OPEN_TAG in text:
        return calls, f"a {OPEN_TAG} without its {CLOSE_TAG}"
    return calls, ""
