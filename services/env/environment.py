"""What every environment is: a name, its tools, and two methods over an episode's state."""

from __future__ import annotations

from typing import Any, Protocol

from services.env.types import EnvReply, EpisodeAction, EpisodeTask, ToolSpec


class Environment(Protocol):
    """One kind of episode. ``start`` makes an episode's state from its task; ``step`` answers
    the model's turn and may change that state. Both run on the server's threads, many
    episodes at once: an environment keeps nothing of an episode outside its state."""

    name: str
    tools: list[ToolSpec]

    def start(self, task: EpisodeTask) -> Any: ...

    def step(self, state: Any, action: EpisodeAction) -> EnvReply: ...


def wrap_tool_response(text: str) -> str:
    """A tool's answer as the Hermes format (Qwen2.5's chat template, verl's default
    ``multi_turn.format``) shows it to the model."""
    return f"\n<tool_response>\n{text}\n</tool_response>\n"
