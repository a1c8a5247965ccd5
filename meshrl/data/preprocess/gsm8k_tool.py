"""GSM8k for multi-turn rollouts with the calculator tool, in verl's layout of
``gsm8k_multiturn_w_tool.py``: a system message that offers the tool in the Hermes format,
the question and GSM8k's instruction as the user message, ``agent_name`` naming the loop,
and ``extra_info.need_tools_kwargs`` / ``tools_kwargs`` for the tool's per-row settings.
Ground truth and data_source as :mod:`meshrl.data.preprocess.gsm8k`."""

from __future__ import annotations

from typing import Any

from meshrl.data.preprocess import gsm8k

DATA_SOURCE = gsm8k.DATA_SOURCE
SPLIT_MAP = gsm8k.SPLIT_MAP
AGENT_NAME = "tool_agent"
"""verl's name of its tool-calling agent loop."""
TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    "You are a math expert. Solve the problem step by step. You may call the calculator "
    "tool to evaluate arithmetic: write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(48 / 2) * 3"}}'
    "</tool_call> and its result comes back between <tool_response> and </tool_response>. "
    'Put your final answer after "####".'
)


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    row = gsm8k.convert(rec, split, index)
    if isinstance(row, str):  # why it was skipped
        return row
    row["prompt"] = [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]]
    row["agent_name"] = AGENT_NAME
    row["extra_info"] |= {
        "need_tools_kwargs": True,
        "tools_kwargs": {
            TOOL_NAME: {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}
        },
    }
    return row
