"""The stages of one PPO step after generation, each a frozen value made by one phase and
read by the phases after it:

    GeneratedBatch (generation/generated.py)
      -> ScoredBatch   the reward phase's Scores beside it
      -> Inferred      old log-probs, reference log-probs, values (the role servers')
      -> Trajectory    advantages and returns (the coordinator's)

No phase fills in another's fields: each returns its own stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch


@dataclass(frozen=True)
class Scores:
    """What the reward phase made of each sample of a batch."""

    scores: torch.Tensor
    """(B·n,) float: the score the advantage sees (the overlong penalty in it)."""
    reward_scores: torch.Tensor
    """(B·n,) float: the reward service's, unshaped."""
    extra: list[dict[str, float]] = field(default_factory=list)
    """Each sample's extra values from its scorer (``acc``, ``rm_cut``, ...)."""
    failures: list[str] = field(default_factory=list)
    """Why the service could not score each sample ("" when it did)."""
    failed: int = 0
    """Samples the reward service could not score (they score 0)."""

    def select(self, rows: list[int]) -> Scores:
        """The scores of ``rows``; ``failed`` counts what the phase met, kept whole."""
        pick = lambda items: [items[r] for r in rows]  # noqa: E731 - one line per field
        return Scores(
            scores=self.scores[rows],
            reward_scores=self.reward_scores[rows],
            extra=pick(self.extra) if self.extra else [],
            failures=pick(self.failures) if self.failures else [],
            failed=self.failed,
        )

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        return Scores(
            scores=torch.cat([p.scores for p in parts]),
            reward_scores=torch.cat([p.reward_scores for p in parts]),
            extra=[x for p in parts for x in p.extra],
            failures=[x for p in parts for x in p.failures],
            failed=sum(p.failed for p in parts),
        )


@dataclass(frozen=True)
class ScoredBatch:
    """A generated batch and its scores, row for row."""

    generated: GeneratedBatch
    scores: Scores

    def __len__(self) -> int:
        return len(self.generated)

    def select_groups(self, groups: list[int]) -> ScoredBatch:
        """The samples of ``groups`` (in that order), renumbered 0..len(groups)-1."""
        rows = self.generated.group_rows(groups)
        return ScoredBatch(self.generated.select_groups(groups), self.scores.select(rows))

    @staticmethod
    def concat(parts: list[ScoredBatch]) -> ScoredBatch:
        """Scored batches one after another, their groups numbered on."""
        return ScoredBatch(
            GeneratedBatch.concat([p.generated for p in parts]),
            Scores.concat([p.scores for p in parts]),
        )


@dataclass(frozen=True)
class Inferred:
    """The role servers' per-token numbers over a generated batch's responses."""

    old_logprobs: Ragged
    """The actor's log-probs with the weights that start the update (the PPO ratio's base)."""
    ref_logprobs: Ragged | None = None
    """The reference policy's; None without a reference."""
    values: Ragged | None = None
    """The critic's; None without a critic."""


@dataclass(frozen=True)
class Trajectory:
    """The coordinator's advantages and returns over a batch's responses."""

    advantages: Ragged
    returns: Ragged
    metrics: dict[str, float] = field(default_factory=dict)
    """``critic/advantages/*``, ``critic/returns/*``, ... of verl."""
