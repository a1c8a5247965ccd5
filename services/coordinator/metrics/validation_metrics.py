"""Validation metrics over n samples a prompt, with verl's names and sections.

Per data_source and variable (``acc``, ``reward``), each prompt's n values give
``mean@n``; with n > 1 also ``std@n`` and, for each k in 2, 4, 8, ... and n, bootstrap
estimates of ``best@k`` and ``worst@k`` (the max and min of k samples drawn with
replacement) and, when the scorer reads answers (``pred``), ``maj@k`` (the value of the
answer most of k samples give). Each metric is the mean of its per-prompt values.

Sections, as verl files them: ``val-core/<ds>/<core>/<metric>`` for the core variable's
``mean@n``, ``maj@n/*`` and ``best@n/*``; everything else under ``val-aux``. The core
variable is ``acc`` where the scorer reports one (every rule scorer does), else ``reward``
(a reward model alone, whose score is no verdict). Where verl's own scorer of a
data_source reports no ``acc`` (GSM8k's, MATH's: a bare float), verl's core variable is the
reward: that data_source's reward is core too (``val-core/openai/gsm8k/reward/mean@1``, the
figure verl's dashboards read), beside meshrl's ``acc``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

ACCURACY = "acc"
REWARD = "reward"
BOOTSTRAPS = 1000


@dataclass(frozen=True)
class SampleResult:
    """One validation sample's outcome."""

    data_source: str
    prompt: int
    """Index of its prompt in the validation set: the n samples of a prompt share it."""
    values: dict[str, float]
    """Variable -> value, e.g. {"acc": 1.0, "reward": 0.9}; no "acc" where the scorer gives
    none (a reward model alone)."""
    pred: str | None = None
    """The answer the scorer read (None: it does not say)."""


def subset_sizes(n: int) -> list[int]:
    """The k of best@k, worst@k and maj@k: powers of two below n, then n. n = 1: none."""
    if n < 2:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def bootstrap_extremes(
    values: np.ndarray, k: int, rng: np.random.Generator
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean, std) of the best and of the worst of k draws with replacement.

    values (n,) one prompt's values; BOOTSTRAPS draws of k indices each.
    """
    draws = values[rng.integers(0, len(values), size=(BOOTSTRAPS, k))]  # (B, k)
    best, worst = draws.max(axis=1), draws.min(axis=1)  # (B,)
    return (float(best.mean()), float(best.std())), (float(worst.mean()), float(worst.std()))


def bootstrap_majority(
    values: np.ndarray, preds: list[str], k: int, rng: np.random.Generator
) -> tuple[float, float]:
    """(mean, std) of the majority vote's value over k draws with replacement.

    values (n,), preds n answers. In each draw the answer given most often wins (a tie goes
    to the answer drawn first, as verl's dict order has it) and its first draw's value counts.
    """
    codes = np.unique(np.asarray(preds, dtype=object), return_inverse=True)[1].reshape(-1)
    idx = rng.integers(0, len(values), size=(BOOTSTRAPS, k))  # (B, k)
    drawn = codes[idx]  # (B, k) answer codes
    answers = int(codes.max()) + 1
    counts = np.zeros((BOOTSTRAPS, answers), dtype=np.int64)  # (B, a)
    np.add.at(counts, (np.arange(BOOTSTRAPS)[:, None], drawn), 1)
    # First position of each answer in the draw; k where absent.
    first = np.full((BOOTSTRAPS, answers), k, dtype=np.int64)  # (B, a)
    np.minimum.at(first, (np.arange(BOOTSTRAPS)[:, None], drawn), np.arange(k)[None, :])
    winner = np.argmax(counts * (k + 1) - first, axis=1)  # (B,) most votes, then first drawn
    rows = np.arange(BOOTSTRAPS)
    picked = values[idx[rows, first[rows, winner]]]  # (B,)
    return float(picked.mean()), float(picked.std())


def prompt_metrics(
    values: np.ndarray, preds: list[str] | None, rng: np.random.Generator
) -> dict[str, float]:
    """One prompt's metrics of one variable, named as verl names them (``best@4/mean``)."""
    n = len(values)
    out = {f"mean@{n}": float(values.mean())}
    if n > 1:
        out[f"std@{n}"] = float(values.std())
    for k in subset_sizes(n):
        (best_mean, best_std), (worst_mean, worst_std) = bootstrap_extremes(values, k, rng)
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = best_mean, best_std
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = worst_mean, worst_std
        if preds is not None:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = bootstrap_majority(values, preds, k, rng)
    return out


def core_variable(variables: set[str]) -> str:
    """verl's choice: the accuracy where a data_source's scorer reports one, else the reward."""
    return ACCURACY if ACCURACY in variables else REWARD


def section(variable: str, metric: str, n: int, core_vars: str | Collection[str] = ACCURACY) -> str:
    """verl's split: a core variable's mean, majority and best at the full n are core."""
    core_vars = {core_vars} if isinstance(core_vars, str) else core_vars
    core = (
        variable in core_vars and metric.startswith(("mean", "maj", "best")) and f"@{n}" in metric
    )
    return "val-core" if core else "val-aux"


def validation_metrics(
    samples: list[SampleResult], seed: int = 42, reward_is_core: Collection[str] = ()
) -> dict[str, float]:
    """``<section>/<data_source>/<variable>/<metric>`` -> the mean over prompts.

    A data_source gets maj@k when its scorer reads answers for any of its samples (a sample
    without one votes as "no answer"). Bootstraps draw from one generator seeded with
    ``seed``, so the same outcomes give the same metrics. ``reward_is_core``: the
    data_sources whose reward is a core variable beside their accuracy (verl's scorer of
    them reports no ``acc``, so verl files their reward as core).
    """
    rng = np.random.default_rng(seed)
    by_prompt: dict[str, dict[int, list[SampleResult]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        by_prompt[s.data_source][s.prompt].append(s)
    metrics: dict[str, float] = {}
    for ds in sorted(by_prompt):
        prompts = by_prompt[ds]
        votes = any(s.pred is not None for group in prompts.values() for s in group)
        per_metric: dict[tuple[str, str], list[float]] = defaultdict(list)
        n_max = max(len(group) for group in prompts.values())
        # A sample the scorer could not score has no accuracy of its own: it counts 0.
        variables = sorted({v for group in prompts.values() for s in group for v in s.values})
        core_vars = {core_variable(set(variables))}
        if ds in reward_is_core:
            core_vars.add(REWARD)
        for group in prompts.values():
            preds = [s.pred or "" for s in group] if votes else None
            for variable in variables:
                values = np.array([s.values.get(variable, 0.0) for s in group], dtype=np.float64)
                for metric, value in prompt_metrics(values, preds, rng).items():
                    per_metric[(variable, metric)].append(value)
        for (variable, metric), per_prompt in sorted(per_metric.items()):
            name = f"{section(variable, metric, n_max, core_vars)}/{ds}/{variable}/{metric}"
            metrics[name] = float(np.mean(per_prompt))
    return metrics
