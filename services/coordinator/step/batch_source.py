"""What a step's batch source is: the points where a step, and the run's loop and recovery
around it, meet the source of its batches (the three sources: ``batch_sources.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

from meshrl.data.loader import PromptLoader
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.generation.weight_sync import WeightSyncer
from services.coordinator.step.stages import Scores
from services.coordinator.step.timing import PhaseTimer

Draw = Callable[[], tuple[int, list, dict]]
"""(epoch, records, loader state before them): the next step's prompts, drawn ahead."""


class StepPhases(Protocol):
    """What a source uses of the step: its generation and reward phases, the replica pool
    and the weight syncer."""

    rollout_pool: RolloutPool
    syncer: WeightSyncer

    def generate(
        self, records: list, step: int, gen_batch: int = 0, mixed_versions: bool = False
    ) -> GeneratedBatch: ...

    def score(self, generated: GeneratedBatch) -> Scores: ...


@dataclass(frozen=True)
class StepBatch:
    """What a source gives the step."""

    generated: GeneratedBatch
    records: list
    """The records of its prompts (PromptRecord), one per group."""
    scores: Scores | None = None
    """Its scores, when the source scored it already (dynamic sampling); None: the step does."""
    metrics: dict[str, float] = field(default_factory=dict)


class BatchSource(ABC):
    """The points where a step, and the run's loop and recovery around it, meet the source.
    The defaults are those of a source that generates nothing outside its step."""

    def prompts(self, step: int, loader: PromptLoader) -> tuple[int, list]:
        """(epoch, records): the prompts the loop draws for ``step``."""
        return loader.next_batch()

    @abstractmethod
    def take(self, step: int, records: list, phases: StepPhases, timer: PhaseTimer) -> StepBatch:
        """Step ``step``'s batch; ``records``: the prompts the loop drew for it."""

    def start_next(self, step: int, phases: StepPhases) -> bool:
        """Called once the batch is taken; whether rollout goes on generating while the
        step trains (its KV cache stays awake), else it sleeps."""
        return False

    def settle(self, timer: PhaseTimer) -> None:
        """Before the weights move: what must end first has ended."""
        return None

    def sync_weights(self, step: int, phases: StepPhases, timer: PhaseTimer) -> dict[str, float]:
        """The actor's weights to rollout as version ``step``."""
        with timer("sync_weights"):
            return phases.syncer.sync(version=step)

    def held(self) -> AbstractContextManager[None]:
        """No batch is generated in the block, and none is in progress when it begins:
        servers are restarted and the pool rebuilt in it."""
        return nullcontext()

    def before_recovery(self) -> None:
        """A failed step is to be recovered from: what was generated for later steps by a
        server that may be restarted now is dropped (it is made again)."""
        return None

    def after_recovery(self, synced: int | None = None) -> None:
        """The recovery is done; ``synced``: the version rollout serves now, when a failed
        weight sync was completed by it (the step is not run again)."""
        return None

    def close(self) -> None:
        """The run ends: whatever generates in the background is left to end."""
        return None
