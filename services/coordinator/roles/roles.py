"""The clients of every role server a run talks to."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.env.client import EnvClient
from services.reward.client import RewardClient
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient


@dataclass
class Roles:
    """Clients of every role server a run talks to."""

    rollouts: list[RolloutClient]
    """Every rollout replica of the run, in the order of ``rollout_names``."""
    actor: TrainerClient
    reward: RewardClient
    critic: TrainerClient | None = None
    ref: TrainerClient | None = None
    rollout_names: list[str] = field(default_factory=list)
    """Each replica's name (``rollout0``, ...); empty: ``rollout<i>`` by position."""
    env: EnvClient | None = None
    """The environment server of a multi-turn run."""

    def named_rollouts(self) -> dict[str, RolloutClient]:
        names = self.rollout_names or [f"rollout{i}" for i in range(len(self.rollouts))]
        return dict(zip(names, self.rollouts, strict=True))
