"""verl's data_source names -> rule scorers.

Scorers are named as ``module:function`` and imported only where they run (the worker
processes), so the server process never loads sympy or math-verify.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

_PKG = "services.reward.scorers"

FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gsm8k": (f"{_PKG}.gsm8k:compute_score", ("openai/gsm8k", "gsm8k")),
    "math": (
        f"{_PKG}.math:compute_score",
        ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"),
    ),
    "hellaswag": (f"{_PKG}.hellaswag:compute_score", ("Rowan/hellaswag", "hellaswag")),
}
"""family -> (scorer, data_source names it scores)."""

DATA_SOURCES: dict[str, str] = {name: fam for fam, (_, names) in FAMILIES.items() for name in names}

VERL_SCORES_WITHOUT_ACC = frozenset(
    {
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    }
)
"""The data_sources verl's own ``default_compute_score`` scores with a bare float (its
``gsm8k`` and ``math_reward``), so verl's validation files their reward as the core metric
(``val-core/openai/gsm8k/reward/mean@1``); meshrl's rule scorers report an ``acc`` as well."""

ScoreFn = Callable[..., float]
AnswerFn = Callable[..., "str | None"]


class UnknownDataSource(ValueError):
    """A data_source no scorer knows; the message lists the known names."""

    def __init__(self, data_source: str, known: list[str] | None = None):
        known = known if known is not None else known_data_sources()
        super().__init__(f"unknown data_source {data_source!r}; known: {', '.join(known)}")
        self.data_source = data_source
        self.known = known

    def __reduce__(self):  # pickles across processes with the same message
        return (UnknownDataSource, (self.data_source, self.known))


def known_data_sources() -> list[str]:
    return list(DATA_SOURCES)


def family_of(data_source: str) -> str:
    """The scorer family of `data_source`; raises UnknownDataSource."""
    try:
        return DATA_SOURCES[data_source]
    except KeyError:
        raise UnknownDataSource(data_source) from None


@cache
def get_scorer(data_source: str) -> ScoreFn:
    """The ``compute_score(solution_str, ground_truth, extra_info)`` of `data_source`."""
    module, fn = FAMILIES[family_of(data_source)][0].split(":")
    return getattr(importlib.import_module(module), fn)


@cache
def get_answer_reader(data_source: str) -> AnswerFn:
    """The ``read_answer(solution_str, extra_info)`` of `data_source`'s scorer module: the
    answer its ``compute_score`` judges, for majority votes (None: no answer found)."""
    module = FAMILIES[family_of(data_source)][0].split(":")[0]
    return importlib.import_module(module).read_answer
