"""The calculator environment for GSM8k-style problems: the model may call ``calculator``
with an arithmetic expression any number of turns, then writes its answer; a turn without a
tool call ends the episode (the reward service scores that answer).

Each call runs in the sandbox (``sandbox.py``): a worker process with a time and memory
limit, evaluating the restricted expression language of ``expression.py``. A call that
fails (a bad expression, the time limit, a crashed worker) answers ``error: ...`` to the
model, and the episode goes on.
"""

from __future__ import annotations

from services.env.environment import wrap_tool_response
from services.env.sandbox import Sandbox, ToolFailed
from services.env.sandbox_process import calculate
from services.env.types import EnvReply, EpisodeAction, EpisodeTask, ToolSpec

CALCULATOR_TOOL = ToolSpec(
    name="calculator",
    description="Evaluates an arithmetic expression (+ - * / // % **, parentheses, "
    "abs round min max sqrt floor ceil) and returns its value.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (48 / 2) * 3 + 7"}},
        "required": ["expression"],
    },
)


class CalculatorEnv:
    name = "calculator"
    tools = [CALCULATOR_TOOL]

    def __init__(self, sandbox: Sandbox, tool_timeout_s: float):
        self.sandbox = sandbox
        self.tool_timeout_s = tool_timeout_s

    def start(self, task: EpisodeTask) -> None:
        return None  # nothing to keep: every call stands alone

    def step(self, state: None, action: EpisodeAction) -> EnvReply:
        if action.parse_error:
            return EnvReply(wrap_tool_response(f"error: {action.parse_error}"))
        if not action.tool_calls:
            return EnvReply("", done=True)  # the answer: the reward service scores it
        answers = [self.answer(call.name, call.arguments) for call in action.tool_calls]
        return EnvReply("".join(wrap_tool_response(a) for a in answers))

    def answer(self, name: str, arguments: dict) -> str:
        if name != CALCULATOR_TOOL.name:
            return f"error: no tool named {name!r} (the tool is {CALCULATOR_TOOL.name!r})"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: the calculator takes one argument, expression, a string"
        try:
            return self.sandbox.call(calculate, (expression,), self.tool_timeout_s)
        except ToolFailed as e:
            return f"error: {e}"
