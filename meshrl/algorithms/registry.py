"""The advantage estimators and policy losses by name: what each needs, where its code is.

One entry per algorithm. Everything that names them reads these tables: the config's
allowed values and their description (``algorithm.adv_estimator``,
``actor_rollout_ref.actor.policy_loss.loss_mode``, so docs/config.md too), the start-up
checks (``meshrl/config/rules.py``, ``services/coordinator/run/preflight.py``), the
coordinator's advantage phase and the actor's loss. docs/extending.md says how to add one; tests/algorithms/test_registry.py keeps
every entry loadable, documented and tested.

This module imports no torch: the config loads it. An entry names its function as
``"module:function"`` (as the reward scorers do), imported at its first call:

- an estimator: ``(EstimatorInputs, AlgorithmConfig) -> AdvantageResult``
  (:mod:`meshrl.algorithms.estimators`);
- a policy loss: ``(PolicyLossInputs, PolicyLossSettings) -> PolicyLoss``
  (:mod:`meshrl.algorithms.loss_modes`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageEstimatorEntry",
    "PolicyLossEntry",
    "advantage_estimator",
    "describe",
    "policy_loss",
]


def _load(function: str) -> Callable[..., Any]:
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class AdvantageEstimatorEntry:
    """One ``algorithm.adv_estimator``: its name, what it is, what the step must give it."""

    name: str
    """The config's value."""
    function: str
    """``"module:function"``, ``(EstimatorInputs, AlgorithmConfig) -> AdvantageResult``."""
    summary: str
    """One phrase: what it computes and where it comes from (docs/config.md shows it)."""
    needs_critic: bool = False
    """Critic values at the advantage phase: a critic is trained (``critic.enable``
    defaults to it; refused at start without one)."""
    needs_greedy_baseline: bool = False
    """The scores of a greedy response to each prompt: one more generation a step (not
    with dynamic sampling, which filters the prompts after that generation)."""
    needs_groups: bool = False
    """A baseline from the other responses to the same prompt (``rollout.n`` of them): with
    ``rollout.n=1`` the raw score is the advantage, and the start says so."""

    def load(self) -> Callable[..., Any]:
        """The estimator's function (imported now, torch with it)."""
        return _load(self.function)

    @property
    def needs(self) -> list[str]:
        """What it needs, in words (empty: the scores alone)."""
        return [
            what
            for wanted, what in (
                (self.needs_critic, "the critic"),
                (self.needs_greedy_baseline, "a greedy baseline: one more generation a step"),
                (self.needs_groups, "groups: rollout.n ≥ 2"),
            )
            if wanted
        ]


@dataclass(frozen=True)
class PolicyLossEntry:
    """One ``actor.policy_loss.loss_mode``: its name, what it is, what the actor must give it."""

    name: str
    """The config's value."""
    function: str
    """``"module:function"``, ``(PolicyLossInputs, PolicyLossSettings) -> PolicyLoss``."""
    summary: str
    """One phrase: what it computes and where it comes from (docs/config.md shows it)."""
    draws: bool = False
    """It draws at random: the actor gives it a generator seeded by the run, the update and
    the micro-batch's rows (``PolicyLossSettings.draw_seed``)."""
    needs_behaviour_logprobs: bool = False
    """The rollout engine's own log-probs of the sampled tokens (the behaviour policy's):
    the actor refuses an update without them."""
    paper_clip_ranges: tuple[str, str] | None = None
    """(what ``clip_ratio_low`` / ``clip_ratio_high`` bound here, the paper's values) where
    they are on another scale than PPO's 0.2: a warning at start when they are left to
    ``clip_ratio``."""

    def load(self) -> Callable[..., Any]:
        """The loss's function (imported now, torch with it)."""
        return _load(self.function)

    @property
    def needs(self) -> list[str]:
        """What it needs beyond the log-probs and advantages, in words."""
        return [
            what
            for wanted, what in (
                (self.draws, "a seeded draw"),
                (self.needs_behaviour_logprobs, "the rollout's log-probs"),
            )
            if wanted
        ]


_EST = "meshrl.algorithms.estimators"
_LOSS = "meshrl.algorithms.loss_modes"

ESTIMATORS: dict[str, AdvantageEstimatorEntry] = {
    e.name: e
    for e in (
        AdvantageEstimatorEntry(
            "gae",
            f"{_EST}:gae",
            "generalised advantage estimation over the token rewards and the critic's "
            "values, γ and λ (Schulman et al. 2016)",
            needs_critic=True,
        ),
        AdvantageEstimatorEntry(
            "grpo",
            f"{_EST}:grpo",
            "the response's reward minus its group's mean, over the group's std unless "
            "norm_adv_by_std_in_grpo=false (DeepSeekMath, Shao et al. 2024)",
            needs_groups=True,
        ),
        AdvantageEstimatorEntry(
            "rloo",
            f"{_EST}:rloo",
            "the response's reward minus the mean of the others of its group "
            "(REINFORCE leave-one-out, Ahmadian et al. 2024)",
            needs_groups=True,
        ),
        AdvantageEstimatorEntry(
            "reinforce_plus_plus",
            f"{_EST}:reinforce_plus_plus",
            "the discounted return-to-go of the token rewards, whitened over the batch "
            "(REINFORCE++, Hu 2025)",
        ),
        AdvantageEstimatorEntry(
            "reinforce_plus_plus_baseline",
            f"{_EST}:reinforce_plus_plus_baseline",
            "the response's reward minus its group's mean, whitened over the batch's tokens "
            "(verl's REINFORCE++-baseline)",
            needs_groups=True,
        ),
        AdvantageEstimatorEntry(
            "remax",
            f"{_EST}:remax",
            "the return-to-go minus the score of the greedy response to the same prompt "
            "(ReMax, Li et al. 2023)",
            needs_greedy_baseline=True,
        ),
    )
}
"""Every advantage estimator, by ``algorithm.adv_estimator``."""

POLICY_LOSSES: dict[str, PolicyLossEntry] = {
    e.name: e
    for e in (
        PolicyLossEntry(
            "vanilla",
            f"{_LOSS}:vanilla",
            "PPO's clipped token ratio with the dual clip (Schulman et al. 2017; Ye et al. 2020)",
        ),
        PolicyLossEntry(
            "gspo",
            f"{_LOSS}:gspo",
            "GSPO's sequence ratio, the geometric mean of a response's token ratios, clipped "
            "once, aggregated seq-mean-token-mean whatever loss_agg_mode says (Zheng et al. "
            "2025)",
            paper_clip_ranges=(
                "a response's ratio",
                "GSPO's paper takes 3e-4 / 4e-4, as a sequence ratio moves far less than a token's",
            ),
        ),
        PolicyLossEntry(
            "geo_mean",
            f"{_LOSS}:geo_mean",
            "GMPO's sequence ratio, the geometric mean of the token ratios each clipped in log "
            "space at -clip_ratio_low / +clip_ratio_high, averaged over responses whatever "
            "loss_agg_mode says (Zhao et al. 2025)",
            paper_clip_ranges=(
                "each token's log-ratio (at -low / +high)",
                "GMPO's paper takes 0.4 / 0.4 (ratios e^-0.4 to e^0.4)",
            ),
        ),
        PolicyLossEntry(
            "clip_cov",
            f"{_LOSS}:clip_cov",
            "PPO without the dual clip, a random few high-covariance tokens taken out of the "
            "loss, chosen per micro-batch as verl (Cui et al. 2025)",
            draws=True,
        ),
        PolicyLossEntry(
            "kl_cov",
            f"{_LOSS}:kl_cov",
            "the unclipped policy gradient with a KL penalty on the highest-covariance tokens, "
            "chosen per micro-batch as verl (Cui et al. 2025)",
        ),
        PolicyLossEntry(
            "cispo",
            "meshrl.algorithms.cispo:cispo",
            "CISPO's REINFORCE gradient of every token weighted by its importance ratio, "
            "clipped and detached, so no token leaves the update (MiniMax-M1, 2025)",
            paper_clip_ranges=(
                "each token's importance weight",
                "MiniMax-M1 sets no lower bound (clip_ratio_low of 1 or more) and tunes "
                "clip_ratio_high alone",
            ),
        ),
    )
}
"""Every policy loss, by ``actor_rollout_ref.actor.policy_loss.loss_mode``."""


def advantage_estimator(name: str) -> AdvantageEstimatorEntry:
    """The entry of ``name``; ValueError for a name no entry has."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}") from None


def policy_loss(name: str) -> PolicyLossEntry:
    """The entry of ``name``; ValueError for a name no entry has."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy_loss.loss_mode {name!r}") from None


def describe(entries: dict[str, AdvantageEstimatorEntry] | dict[str, PolicyLossEntry]) -> str:
    """The entries as one text, ``name (needs ...): summary; ...``: the config field's
    description, so docs/config.md lists every entry."""
    parts = []
    for entry in entries.values():
        needs = f" (needs {', '.join(entry.needs)})" if entry.needs else ""
        text = f"{entry.name}{needs}: {entry.summary}"
        if isinstance(entry, PolicyLossEntry) and entry.paper_clip_ranges is not None:
            what, paper = entry.paper_clip_ranges
            text += f", clip_ratio_low / clip_ratio_high bound {what}: {paper}"
        parts.append(text)
    return "; ".join(parts) + "."
