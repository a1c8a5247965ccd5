"""Fully asynchronous rollout (``trainer.async_training``): a producer thread generates batch
after batch into a bounded buffer while the steps train on what is in it.

    producer: draw B prompts -> generate (rollout pool) -> B groups into the buffer -> ...
    step k:   take B groups at most max_staleness versions behind version k-1 -> train ->
              sync weights as version k (the producer's requests paused around it unless
              rollout.partial_rollout) -> tell the producer

Each sample carries the weight version of each of its tokens (``GeneratedBatch.versions``);
its staleness is counted from its oldest token (:mod:`services.coordinator.generation.staleness`).
``stale: wait``: the producer starts the batch meant for step j only once rollout serves
version j - 1 - max_staleness or newer, so no sample ever exceeds the bound. ``stale:
drop``: it never waits for the trainers; groups past the bound when a step takes its batch
are dropped and counted. Either way the buffer holds at most ``buffer_batches`` batches, the
one being generated included.

Checkpoints save the loader state from before the oldest batch drawn whose prompts are not
all taken (as :class:`~services.coordinator.generation.rollout_ahead.RolloutAhead` does for one batch):
a resumed run draws and generates them again. A rewind (recovery) empties the buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from meshrl.config.sections import AsyncTrainingConfig
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.rollout_ahead import DrawnPrompts
from services.coordinator.generation.staleness import sample_lags, staleness_metrics

log = logging.getLogger(__name__)

Draw = Callable[[], tuple[int, list, dict]]
"""(epoch, records, loader state before them): the next batch of prompts."""
Generate = Callable[[list, int], GeneratedBatch]
"""(records, step the batch is drawn for) -> the generated batch."""


@dataclass
class BufferedGroup:
    """One prompt's n samples, generated and waiting to be trained on."""

    samples: GeneratedBatch
    record: object
    """Its prompt's record (PromptRecord), as the loader gave it."""
    oldest_version: int
    """The weight version of its oldest token."""
    drawn_for: int
    """The step its batch was drawn for (which batch of the producer it came from)."""
    epoch: int
    loader_state: dict
    """The loader's state from before its batch was drawn."""


@dataclass
class TakenBatch:
    batch: GeneratedBatch
    records: list
    """Its prompts' records, in the batch's group order."""
    epoch: int
    """The data epoch of its newest prompt."""
    metrics: dict[str, float]
    """``async/*`` and ``timing_s/trainer_idle``, ``timing_s/rollout_idle``."""
    gen_seconds: float
    """Seconds the producer spent generating the batches it finished since the last take."""


def split_groups(batch: GeneratedBatch, drawn: DrawnPrompts) -> list[BufferedGroup]:
    """A generated batch as its prompts' groups, each with its oldest version."""
    oldest = batch.sample_versions()
    groups = []
    for g in range(int(batch.group_ids.max()) + 1 if len(batch) else 0):
        rows = (batch.group_ids == g).nonzero().flatten()
        version = int(oldest[rows].min())
        samples = batch.select_groups([g])
        record = drawn.records[g]
        groups.append(
            BufferedGroup(samples, record, version, drawn.step, drawn.epoch, drawn.loader_state)
        )
    return groups


class AsyncRollout:
    """The producer thread and its buffer; every method is called from the run's thread."""

    def __init__(self, cfg: AsyncTrainingConfig, batch_size: int) -> None:
        self.max_staleness = cfg.max_staleness
        self.wait_for_versions = cfg.stale == "wait"
        self.batch_size = batch_size
        self.capacity = cfg.buffer_batches * batch_size  # groups, the one generating included
        self._cond = threading.Condition()
        self._buffer: deque[BufferedGroup] = deque()
        self._thread: threading.Thread | None = None
        self._producer = 0  # which start() the running producer thread is: older ones end
        self._holds = 0
        self._drawn: DrawnPrompts | None = None  # the batch being generated (or to retry)
        self._generating = False
        self._error: BaseException | None = None
        self.version = 0  # the weight version rollout serves
        self._taken_through = 0  # the last step that took its batch
        self._last_step = 0  # the run's last step: no batch is drawn past what it needs
        # since the last take
        self._dropped = 0
        self._rollout_idle = 0.0
        self._gen_seconds = 0.0

    # --- the producer -------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, step: int, last_step: int, draw: Draw, generate: Generate) -> None:
        """Starts generating for the steps after ``step`` up to ``last_step``, rollout
        serving version ``step``."""
        assert self._thread is None, "the producer runs already"
        with self._cond:
            self._producer += 1
            self.version = step
            self._taken_through = step
            self._last_step = last_step
        self._thread = threading.Thread(
            target=self._produce,
            args=(self._producer, draw, generate),
            name="async-rollout",
            daemon=True,  # a process that ends does not wait for its generation
        )
        self._thread.start()

    def _may_start(self) -> bool:
        """Whether the next batch may start (under the lock): not held, no failure waiting
        for a retry, room in the buffer, prompts still needed by the run's steps, and
        (``wait``) the bound kept for the step it is drawn for."""
        if self._holds or self._error is not None:
            return False
        if len(self._buffer) + self.batch_size > self.capacity:
            return False
        needed = (self._last_step - self._taken_through) * self.batch_size
        if self._drawn is None and len(self._buffer) >= needed:
            return False
        step = self._drawn.step if self._drawn is not None else self._next_step()
        return not self.wait_for_versions or self.version >= step - 1 - self.max_staleness

    def _next_step(self) -> int:
        """The step the next batch drawn is meant for: after those buffered (under the lock)."""
        return self._taken_through + len(self._buffer) // self.batch_size + 1

    def _produce(self, producer: int, draw: Draw, generate: Generate) -> None:
        while True:
            with self._cond:
                idle_from = time.perf_counter()
                self._cond.wait_for(lambda: self._producer != producer or self._may_start())
                if self._producer != producer:
                    return  # closed, or another producer started after a rewind
                self._rollout_idle += time.perf_counter() - idle_from
                if self._drawn is None:  # a batch that failed is retried with its prompts
                    epoch, records, before = draw()
                    self._drawn = DrawnPrompts(self._next_step(), epoch, records, before)
                drawn = self._drawn
                self._generating = True
            started = time.perf_counter()
            try:
                batch = generate(drawn.records, drawn.step)
            except BaseException as e:  # noqa: BLE001 - raised by take(), in the run's thread
                with self._cond:
                    if self._producer == producer:
                        log.info("async rollout: the batch for step %d failed (%s)", drawn.step, e)
                        self._error = e
                    self._generating = False
                    self._cond.notify_all()
                continue
            groups = split_groups(batch, drawn)
            with self._cond:
                if self._producer == producer:
                    self._buffer.extend(groups)
                    self._drawn = None
                    self._gen_seconds += time.perf_counter() - started
                self._generating = False
                self._cond.notify_all()

    # --- the steps' side ----------------------------------------------------------------
    def take(self, step: int) -> TakenBatch:
        """The next ``batch_size`` groups at most ``max_staleness`` versions behind version
        ``step - 1``, waiting for them; groups past the bound are dropped (counted). A
        generation that failed raises its error here, once it holds the step up; the
        producer then waits for ``retry()``."""
        actor_version = step - 1
        start = time.perf_counter()
        with self._cond:
            while True:
                self._drop_stale(actor_version)
                if len(self._buffer) >= self.batch_size:
                    break
                if self._error is not None:
                    error = self._error
                    raise error
                if self._thread is None:
                    raise RuntimeError("async rollout: the producer is not running")
                self._cond.wait()
            depth = len(self._buffer) / self.batch_size
            taken = [self._buffer.popleft() for _ in range(self.batch_size)]
            self._taken_through = step
            dropped, self._dropped = self._dropped, 0
            rollout_idle, self._rollout_idle = self._rollout_idle, 0.0
            gen_seconds, self._gen_seconds = self._gen_seconds, 0.0
            self._cond.notify_all()  # room for the producer
        batch = GeneratedBatch.concat([g.samples for g in taken])
        lags = sample_lags(batch.sample_versions(), actor_version)
        metrics = {
            **staleness_metrics(lags, self.max_staleness),
            "async/buffer_depth": depth,
            "async/dropped_samples": float(dropped),
            "timing_s/trainer_idle": time.perf_counter() - start,
            "timing_s/rollout_idle": rollout_idle,
        }
        records = [g.record for g in taken]
        epoch = max(g.epoch for g in taken)
        return TakenBatch(batch, records, epoch, metrics, gen_seconds)

    def _drop_stale(self, actor_version: int) -> None:
        """Drops the buffered groups past the bound (under the lock): they only get older."""
        fresh = deque(
            g for g in self._buffer if actor_version - g.oldest_version <= self.max_staleness
        )
        for g in self._buffer:
            if actor_version - g.oldest_version > self.max_staleness:
                self._dropped += len(g.samples)
                if self.wait_for_versions:  # started within the bound: rollout lagged behind
                    log.warning(
                        "async rollout: a prompt generated with weight version %d is %d "
                        "versions behind the actor's %d: dropped",
                        g.oldest_version, actor_version - g.oldest_version, actor_version,
                    )  # fmt: skip
        if len(fresh) != len(self._buffer):
            self._buffer = fresh
            self._cond.notify_all()

    def weights_synced(self, version: int) -> None:
        """Rollout serves ``version`` now: batches waiting for it may start."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def retry(self) -> None:
        """After a failed step was recovered from: a batch whose generation failed is
        generated again, from the same prompts."""
        with self._cond:
            self._error = None
            self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        """No batch starts in the block, and the one being generated has ended when it
        begins (its groups kept, or its failure kept for ``take``): servers may be restarted
        and the pool rebuilt meanwhile."""
        with self._cond:
            self._holds += 1
            self._cond.wait_for(lambda: not self._generating)
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    # --- checkpoints and rewinds --------------------------------------------------------
    def loader_state(self, current: dict, step: int) -> dict:
        """The loader state a checkpoint of ``step`` saves: from before the oldest batch
        drawn whose prompts are not all taken, else ``current`` (read before the lock is
        taken: a draw that came meanwhile is pending, and its state from before is used)."""
        with self._cond:
            pending = [(g.drawn_for, g.loader_state) for g in self._buffer]
            if self._drawn is not None:
                pending.append((self._drawn.step, self._drawn.loader_state))
        if not pending:
            return current
        return min(pending, key=lambda p: p[0])[1]

    def forget(self) -> None:
        """The run went back to a checkpoint: the producer stops and the buffer empties
        (the loader is restored with the rest; ``start`` begins again from there)."""
        self.close()
        with self._cond:
            self._buffer.clear()
            self._drawn, self._error = None, None
            self._dropped, self._rollout_idle, self._gen_seconds = 0, 0.0, 0.0

    def close(self) -> None:
        """Stops the producer: it starts no other batch, and what its generation in progress
        gives is thrown away (that generation is left to its daemon thread)."""
        with self._cond:
            self._producer += 1
            self._cond.notify_all()
        self._thread = None
