"""The rollout servers' KV caches on a GPU they share with the trainer roles.

With ``rollout.free_cache_engine`` (verl's key), the caches are given back after each
generation, so the actor, critic and reference have the GPU's memory for their passes and
updates, and taken again before the next generation (or validation). Weight syncs need no
cache: they land in the engine's parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from meshrl.config.placement import hands_gpu_memory_over
from meshrl.config.schema import RunConfig
from services.rollout.client import RolloutClient

log = logging.getLogger(__name__)


class RolloutMemory:
    """Releases and resumes every rollout server's cache; a no-op when not enabled.
    ``rollouts``: a list, or the run's pool, whose live replicas are asked each time."""

    def __init__(self, rollouts: Iterable[RolloutClient], enabled: bool):
        self.rollouts = rollouts
        self.enabled = enabled
        self.released = False

    @staticmethod
    def for_run(cfg: RunConfig, rollouts: Iterable[RolloutClient]) -> RolloutMemory:
        return RolloutMemory(rollouts, hands_gpu_memory_over(cfg))

    def wake(self) -> None:
        """Takes the caches back. Asked of every server each time (idempotent there): after
        a recovery this object is new, but the servers that survived still sleep."""
        if self.enabled or self.released:
            for rollout in self.rollouts:
                rollout.set_memory_state(release=False)
            self.released = False

    def sleep(self) -> None:
        """Gives the caches back until the next ``wake``."""
        if self.enabled and not self.released:
            rollouts = list(self.rollouts)
            freed = sum(rollout.set_memory_state(release=True) == 0 for rollout in rollouts)
            log.debug("rollout caches released on %d of %d servers", freed, len(rollouts))
            self.released = True
