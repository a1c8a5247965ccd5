"""Where a step's batch comes from: one interface, three ways (verl's three modes).

    SynchronousBatches  generated in the step, with the weights of the step before
                        (with dynamic sampling: batch after batch until enough groups vary)
    OneStepOffBatches   generated during the step before, with the weights before those
                        (``trainer.one_step_off_policy``: rollout_ahead.py)
    FullyAsyncBatches   taken from a producer's buffer, generated meanwhile
                        (``trainer.async_training``: async_rollout.py)

The step calls each source at the same four points (:meth:`PPOStep.run`): ``take`` its batch;
``start_next`` while it trains; ``settle`` before the weights move; ``sync_weights``. The run
asks it for each step's ``prompts``, and its recovery holds it (``held``) and tells it
(``before_recovery``, ``after_recovery``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

from meshrl.config.sections import FilterGroupsConfig
from meshrl.data.loader import PromptLoader
from services.coordinator.generation.async_rollout import AsyncRollout
from services.coordinator.generation.rollout_ahead import RolloutAhead
from services.coordinator.step.batch_source import BatchSource, Draw, StepBatch, StepPhases
from services.coordinator.step.dynamic_sampling import (
    FilterGroupsExhausted,
    filter_values,
    varied_groups,
)
from services.coordinator.step.stages import ScoredBatch
from services.coordinator.step.timing import PhaseTimer

log = logging.getLogger(__name__)


class SynchronousBatches(BatchSource):
    """Generated in the step, with the weights of the step before. With dynamic sampling
    (``algorithm.filter_groups``), generates and scores batch after batch of prompts
    (``data.gen_batch_size`` each: the step's own, then ``draw_records(1)``,
    ``draw_records(2)``, ...) and keeps the groups whose samples differ, until
    ``data.train_batch_size`` prompts are kept; the first that many make the batch."""

    def __init__(
        self,
        filter_groups: FilterGroupsConfig,
        train_batch_size: int,
        draw_records: Callable[[int], list] | None = None,
    ) -> None:
        """``draw_records(i)``: the step's i-th further batch of prompts (dynamic sampling)."""
        if filter_groups.enable and draw_records is None:
            raise ValueError("dynamic sampling needs draw_records")
        self.filter_groups = filter_groups
        self.train_batch_size = train_batch_size
        self.draw_records = draw_records

    def take(self, step: int, records: list, phases: StepPhases, timer: PhaseTimer) -> StepBatch:
        if self.filter_groups.enable:
            return self.varied(step, records, phases, timer)
        with timer("gen"):
            return StepBatch(phases.generate(records, step), records)

    def varied(self, step: int, records: list, phases: StepPhases, timer: PhaseTimer) -> StepBatch:
        """Raises FilterGroupsExhausted past ``max_num_gen_batches``."""
        assert self.draw_records is not None  # checked at construction
        fg, wanted = self.filter_groups, self.train_batch_size
        kept: list[ScoredBatch] = []
        first_records = records
        have = generated = gen_batches = 0
        while True:
            with timer("gen"):
                batch = phases.generate(records, step, gen_batches)
            gen_batches += 1
            with timer("reward"):
                scored = ScoredBatch(batch, phases.score(batch))
            groups = varied_groups(filter_values(fg.metric, scored.scores), batch.group_ids)
            kept.append(scored.select_groups(groups))
            have, generated = have + len(groups), generated + len(records)
            if have >= wanted:
                break
            if 0 < fg.max_num_gen_batches <= gen_batches:
                raise FilterGroupsExhausted(
                    f"step {step}: {have} of the {wanted} prompts a batch needs had samples "
                    f"that differ in {fg.metric} after {gen_batches} generation batches "
                    f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); "
                    "the data is too easy or too hard for the model: raise the limit, "
                    "change the data, or set algorithm.filter_groups.enable=false"
                )
            log.info(
                "step %d: %d of %d prompts with varied %s after %d generation batches; "
                "generating more",
                step,
                have,
                wanted,
                fg.metric,
                gen_batches,
            )
            records = self.draw_records(gen_batches)
        chosen = ScoredBatch.concat(kept).select_groups(list(range(wanted)))
        metrics = {
            "train/num_gen_batches": float(gen_batches),
            "train/kept_prompts_ratio": have / generated,
        }
        return StepBatch(chosen.generated, first_records, chosen.scores, metrics)


class OneStepOffBatches(BatchSource):
    """``trainer.one_step_off_policy``: the step trains on the batch generated during the
    step before, if there is one, and generates the next step's while it trains. Its
    generation time is ``timing_s/gen`` (spent alongside that step's training); what the step
    waited for it is ``timing_s/gen_wait``."""

    def __init__(self, ahead: RolloutAhead, next_prompts: Callable[[], Draw | None]) -> None:
        """``next_prompts()``: how the next step's prompts are drawn; None: no next step."""
        self.ahead = ahead
        self.next_prompts = next_prompts

    def prompts(self, step: int, loader: PromptLoader) -> tuple[int, list]:
        """Those drawn for ``step`` during the step before, else the loader's next."""
        return self.ahead.prompts_for(step) or loader.next_batch()

    def take(self, step: int, records: list, phases: StepPhases, timer: PhaseTimer) -> StepBatch:
        with timer("gen_wait"):
            ahead = self.ahead.take(step)
        if ahead is not None:
            timer.add("gen", ahead.seconds)
            return StepBatch(ahead.batch, records)
        with timer("gen"):
            return StepBatch(phases.generate(records, step), records)

    def start_next(self, step: int, phases: StepPhases) -> bool:
        """The next batch, with this step's weights (rollout keeps its KV cache for it)."""
        draw = self.next_prompts()
        return draw is not None and self.ahead.start(step + 1, draw, phases.generate)

    def settle(self, timer: PhaseTimer) -> None:
        """The weights move once the batch ahead is generated."""
        with timer("gen_wait"):
            self.ahead.settle()

    def before_recovery(self) -> None:
        self.ahead.drop()  # ends first; its prompts stay drawn

    def close(self) -> None:
        self.ahead.close()


class FullyAsyncBatches(BatchSource):
    """``trainer.async_training``: the step takes its batch (and its prompts' records) from
    the producer's buffer, which goes on generating meanwhile."""

    def __init__(
        self, producer: AsyncRollout, partial_rollout: bool, start: Callable[[], None]
    ) -> None:
        """``start()``: starts the producer if it is not running (the run's start, a rewind)."""
        self.producer = producer
        self.partial_rollout = partial_rollout
        self.start = start

    def prompts(self, step: int, loader: PromptLoader) -> tuple[int, list]:
        """None: the producer draws them (the epoch is its batch's)."""
        self.start()
        return 0, []

    def take(self, step: int, records: list, phases: StepPhases, timer: PhaseTimer) -> StepBatch:
        taken = self.producer.take(step)
        timer.add("gen", taken.gen_seconds)  # generated alongside the steps before
        metrics = {**taken.metrics, "training/epoch": float(taken.epoch)}
        return StepBatch(taken.batch, taken.records, metrics=metrics)

    def start_next(self, step: int, phases: StepPhases) -> bool:
        return True  # the producer never stops for a step

    def sync_weights(self, step: int, phases: StepPhases, timer: PhaseTimer) -> dict[str, float]:
        """Generation goes on: with ``rollout.partial_rollout`` the sync runs beside the
        Generate calls in flight (each engine applies it at a token boundary); without, the
        pool's requests are held back and those in flight waited for
        (``timing_s/gen_drain``) first."""
        if self.partial_rollout:
            metrics = super().sync_weights(step, phases, timer)
        else:
            with phases.rollout_pool.gate.closed() as drained:
                timer.add("gen_drain", drained)
                metrics = super().sync_weights(step, phases, timer)
        self.producer.weights_synced(step)
        return metrics

    def held(self) -> AbstractContextManager[None]:
        return self.producer.held()

    def after_recovery(self, synced: int | None = None) -> None:
        self.producer.retry()  # a batch whose generation failed is made again
        if synced is not None:
            self.producer.weights_synced(synced)

    def close(self) -> None:
        self.producer.close()
