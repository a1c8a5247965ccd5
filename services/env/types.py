"""Typed containers of the environment service; protos are converted to these at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A tool an environment offers, as OpenAI's function-calling schema declares it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the call's arguments object."""


@dataclass(frozen=True)
class EnvironmentSpec:
    name: str
    tools: list[ToolSpec] = field(default_factory=list)


@dataclass(frozen=True)
class EpisodeTask:
    """What one episode starts from: its data set row's task."""

    environment: str
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The row's extra_info; verl's ``tools_kwargs`` lives here."""
    seed: int = 0


@dataclass(frozen=True)
class EpisodeStarted:
    episode_id: str
    tools: list[ToolSpec] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of the model's turn."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class EpisodeAction:
    """The model's turn in one episode."""

    episode_id: str
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str = ""
    """Why a tool call in the text could not be read ("" when none failed)."""


@dataclass(frozen=True)
class EnvReply:
    """What an environment answers one turn with, before tokenization."""

    text: str
    reward: float = 0.0
    done: bool = False


@dataclass(frozen=True)
class StepResult:
    episode_id: str
    observation_text: str = ""
    observation_ids: list[int] = field(default_factory=list)
    """The observation's token ids (the run's tokenizer), appended to the sequence as they
    are: the history is never tokenized again."""
    reward: float = 0.0
    done: bool = False
    error: str = ""
    """Why the step failed ("" when it did not); the episode is done then."""
