"""One-step off-policy generation (``trainer.one_step_off_policy``): step k+1's batch is
generated while step k scores, infers and updates.

    sync:   gen(k) -> train(k) -> sync(k) -> gen(k+1) -> train(k+1) -> sync(k+1) ...
    ahead:  gen(k) -> train(k)   -> sync(k) -> train(k+1) -> sync(k+1) ...
                      gen(k+1) ---^           gen(k+2) ----^

Rollout still serves step k-1's weights while step k trains, so batch k+1 comes from the
policy one update behind the actor that trains on it (its PPO ratio is taken against the
actor's own old log-probs, as in every step). Weights move only once the generation ahead
has ended: a sync never lands in the middle of a batch.

The prompts of step k+1 are drawn from the loader when its generation starts. The loader's
state from before that draw is kept, and a checkpoint saves it, so a run resumed from step k
draws those prompts again (and generates them with step k's weights).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from services.coordinator.generation.generated import GeneratedBatch

log = logging.getLogger(__name__)


class PromptsDrawnAhead(Protocol):
    """Prompts drawn from the loader before the step that trains on them (one step off
    policy, fully async): what checkpoints and rewinds must know of them."""

    def loader_state(self, current: dict, step: int) -> dict:
        """The loader state a checkpoint of ``step`` saves (``current``: the loader's now)."""
        ...

    def forget(self) -> None:
        """The run went back to a checkpoint: what was drawn ahead is abandoned."""
        ...


@dataclass
class DrawnPrompts:
    """The prompts of a step drawn before the step began, and the loader state before them."""

    step: int
    epoch: int
    records: list
    loader_state: dict


@dataclass
class Generated:
    batch: GeneratedBatch
    seconds: float
    """How long the generation took, in its own thread."""


class RolloutAhead:
    """The next step's prompts and their generation in the background, one at a time."""

    def __init__(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """``stopping()``: whether the run is ending, so no next batch is to be started."""
        self.drawn: DrawnPrompts | None = None
        self.stopping = stopping
        self._future: Future[Generated] | None = None

    # --- the loop's side: prompts and checkpoints ---------------------------------------
    def prompts_for(self, step: int) -> tuple[int, list] | None:
        """(epoch, records) drawn for ``step`` ahead of it, else None (the loader's next)."""
        if self.drawn is not None and self.drawn.step == step:
            return self.drawn.epoch, self.drawn.records
        return None

    def loader_state(self, current: dict, step: int) -> dict:
        """The loader state a checkpoint of ``step`` saves: from before the prompts drawn
        for a later step, which has not run (``current`` when none are)."""
        if self.drawn is not None and self.drawn.step > step:
            return self.drawn.loader_state
        return current

    def forget(self) -> None:
        """The run went back to a checkpoint: the prompts drawn ahead belong to a history
        that is abandoned (the loader is restored with the rest)."""
        self.drop()
        self.drawn = None

    # --- the step's side ----------------------------------------------------------------
    def start(
        self,
        step: int,
        draw: Callable[[], tuple[int, list, dict]],
        generate: Callable[[list, int], GeneratedBatch],
    ) -> bool:
        """Generates ``step``'s batch in the background with the weights rollout serves now;
        False when the run is stopping (nothing started: that batch would be thrown away).
        ``draw()`` gives (epoch, records, loader state before them) the first time a step's
        prompts are needed; a step that is retried reuses them."""
        self.drop()
        if self.stopping():
            return False
        if self.drawn is None or self.drawn.step != step:
            epoch, records, state = draw()
            self.drawn = DrawnPrompts(step, epoch, records, state)
        records = self.drawn.records

        future: Future[Generated] = Future()

        def run() -> None:
            start = time.perf_counter()
            try:
                future.set_result(Generated(generate(records, step), time.perf_counter() - start))
            except BaseException as e:  # noqa: BLE001 - handed to take(), which raises it
                future.set_exception(e)

        # A daemon thread: a process that ends (an error, a second Ctrl-C) does not wait for
        # a Generate call still running, up to its RPC deadline, as it would for a pool's.
        threading.Thread(target=run, name=f"rollout-ahead-{step}", daemon=True).start()
        self._future = future
        return True

    def take(self, step: int) -> Generated | None:
        """``step``'s batch generated ahead, once it is done; None when there is none (the
        step generates its own). A generation that failed raises its error here, once, in
        the step that needed it: that step's recovery deals with it, and its retry then
        generates the batch itself."""
        if self._future is None or self.drawn is None or self.drawn.step != step:
            return None
        future, self._future = self._future, None
        return future.result()

    def settle(self) -> float:
        """Waits until the generation ahead has ended (before the weights move); returns the
        seconds waited. Its error, if any, is kept for ``take``."""
        if self._future is None:
            return 0.0
        start = time.perf_counter()
        self._future.exception()
        return time.perf_counter() - start

    def drop(self) -> None:
        """Discards a generation ahead once it has ended (its prompts stay drawn). After a
        failed step: its servers may be restarted and re-synced, so the batch is made again."""
        if self._future is None:
            return
        future, self._future = self._future, None
        if (error := future.exception()) is not None:
            assert self.drawn is not None  # drawn before its generation started
            log.info("the generation ahead for step %d is dropped (%s)", self.drawn.step, error)

    def close(self) -> None:
        """Leaves a generation still running to its thread (which the process does not wait
        for) and forgets it."""
        self._future = None
