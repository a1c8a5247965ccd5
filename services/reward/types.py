"""Typed containers of the reward service; protos are converted to these at the server edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScoreItem:
    """One response to score."""

    data_source: str
    """Picks the rule scorer, e.g. "openai/gsm8k"."""
    response: str
    """Decoded response text."""
    ground_truth: str = ""
    """reward_model.ground_truth of the prompt's row."""
    prompt: str = ""
    """Prompt for a reward model: plain user text, or a JSON chat message list."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """The row's extra_info (HellaSwag's endings live here)."""


@dataclass
class ScoreOutcome:
    """The reward of one item. A failed scorer gives score 0, ok False and the reason."""

    score: float
    ok: bool = True
    reason: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    """e.g. "rule_score", "rm_score", "acc"."""
    pred: str | None = None
    """The answer the scorer read from the response, for majority votes over a prompt's
    samples ("" when it found none; None when the scorer does not say)."""

    @property
    def reported_acc(self) -> float | None:
        """The scorer's own ``acc`` (every rule scorer gives one); None where it gives none:
        a reward model's score is no verdict, and validation then reports the reward alone."""
        return self.extra.get("acc")

    @property
    def failure(self) -> str:
        """Why the reward service could not score the sample; "" when it did."""
        return "" if self.ok else self.reason or "not scored (no reason given)"


def sample_acc(score: float, extra: dict[str, float]) -> float:
    """A sample's accuracy: the reward's ``acc`` extra (every rule scorer gives one), else
    whether the score reached 1 (a reward model alone, a custom function without it)."""
    return extra.get("acc", float(score >= 1.0))


CANCELLED_REASON = "cancelled: its caller left or the server is stopping"
"""Why a sample has no score when its call was abandoned before it was scored."""


class ScoringCancelled(Exception):
    """A call's scoring stopped because its caller left or the server is stopping."""


def failed(reason: str) -> ScoreOutcome:
    return ScoreOutcome(score=0.0, ok=False, reason=reason)


REWARD_MODEL_KEY = "reward.reward_model.path"
"""The config key of the reward model's path (`meshrl reward serve` says --reward-model)."""


class RewardModelError(ValueError):
    """A reward model that cannot be loaded, or a model that is no reward model. The message
    starts with the setting that gave its path (a bad request: INVALID_ARGUMENT, exit 2)."""

    def __init__(self, problem: str, key: str = REWARD_MODEL_KEY):
        super().__init__(f"{key}: {problem}")
        self.problem = problem
        self.key = key

    def naming(self, key: str) -> RewardModelError:
        """The same problem, said of another setting (e.g. ``--reward-model``)."""
        return RewardModelError(self.problem, key)

    def __reduce__(self):
        return (RewardModelError, (self.problem, self.key))
