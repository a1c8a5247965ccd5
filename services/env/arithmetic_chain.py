"""A multi-turn arithmetic dialogue: the prompt asks a first question, and every right or
wrong answer is followed by the next question about the previous result ("Now multiply
that by 3."), so an episode takes one turn per question, three or more.

The row's ``extra_info.interaction_kwargs`` (verl's key for an interaction's settings)
holds ``answers`` (the expected number after each turn) and ``questions`` (what the
environment asks after turn 1, 2, ...: one fewer than the answers). Each right answer earns
``1 / len(answers)``, placed on that turn's last token; the last answer is also the row's
ground truth, which the reward service scores (``#### N``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.env.types import EnvReply, EpisodeAction, EpisodeTask

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class ChainState:
    answers: list[float]
    questions: list[str]
    turn: int = 0


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


class ArithmeticChainEnv:
    name = "arithmetic_chain"
    tools: list = []  # the model answers in plain text

    def start(self, task: EpisodeTask) -> ChainState:
        kwargs = task.extra_info.get("interaction_kwargs") or {}
        answers = [float(a) for a in kwargs.get("answers", [])]
        questions = [str(q) for q in kwargs.get("questions", [])]
        if not answers or len(questions) != len(answers) - 1:
            raise ValueError(
                "arithmetic_chain: extra_info.interaction_kwargs needs answers (one per turn) "
                f"and questions (one fewer); got {len(answers)} and {len(questions)}"
            )
        return ChainState(answers, questions)

    def step(self, state: ChainState, action: EpisodeAction) -> EnvReply:
        expected = state.answers[state.turn]
        right = last_number(action.text) == expected
        reward = 1.0 / len(state.answers) if right else 0.0
        state.turn += 1
        if state.turn == len(state.answers):
            return EnvReply("", reward=reward, done=True)
        verdict = "Right." if right else f"Wrong, it is {expected:g}."
        return EnvReply(f"\n{verdict} {state.questions[state.turn - 1]}\n", reward=reward)
