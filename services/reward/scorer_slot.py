"""ScorerSlot: the RewardScorer in service, lent to many Score calls at once.

Score calls borrow the scorer concurrently (at most `max_calls` at a time; the rest wait for a
place), so one slow batch no longer blocks the others: each call's samples go into the shared
worker pool, whose per-sample timeouts start when a worker takes the sample. Initialize swaps
a new scorer in: calls that start after the swap get the new one, and the old one closes only
once the last call that borrowed it has its results (none is cut off).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from services.reward.arguments import DEFAULT_MAX_CALLS
from services.reward.scoring import RewardScorer


class NotReady(Exception):
    """No scorer is in service yet (the server is starting its workers)."""


class ScorerSlot:
    def __init__(self, max_calls: int = DEFAULT_MAX_CALLS):
        if max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        self._scorer: RewardScorer | None = None
        self._places = threading.BoundedSemaphore(max_calls)
        self._changed = threading.Condition()  # guards _scorer and _borrowers
        self._borrowers: dict[RewardScorer, int] = {}  # scorer -> calls using it now
        self._abandoned = False  # the server is stopping: no scorer goes into service again

    @property
    def current(self) -> RewardScorer | None:
        return self._scorer

    @contextmanager
    def borrow(self) -> Iterator[RewardScorer]:
        """The scorer in service, for one call; NotReady before the first swap."""
        with self._places:
            with self._changed:
                scorer = self._scorer
                if scorer is None:
                    raise NotReady(
                        "reward server is stopping"
                        if self._abandoned
                        else "reward server is starting its workers"
                    )
                self._borrowers[scorer] = self._borrowers.get(scorer, 0) + 1
            try:
                yield scorer
            finally:
                with self._changed:
                    self._borrowers[scorer] -= 1
                    self._changed.notify_all()

    def swap(self, scorer: RewardScorer | None) -> None:
        """Puts `scorer` in service (None: takes the current one out), then closes the previous
        one once the calls that borrowed it are done."""
        with self._changed:
            too_late = self._abandoned and scorer is not None  # built while the server stopped
            if not too_late:
                old, self._scorer = self._scorer, scorer
                if old is None:
                    return
                self._changed.wait_for(lambda: self._borrowers.get(old, 0) == 0)
                self._borrowers.pop(old, None)
        if too_late:
            assert scorer is not None  # too_late says so
            scorer.abandon()
            return
        assert old is not None  # returned above when None
        old.close()

    def close(self) -> None:
        self.swap(None)

    def abandon(self, timeout_s: float) -> int:
        """Takes the scorer out of service and abandons every scorer still lent (see
        `RewardScorer.abandon`), so the calls using them return now with failed samples;
        closes the rest. Returns how many calls are still running after `timeout_s`: a
        reward-model micro-batch under way cannot be cut short."""
        with self._changed:
            self._abandoned = True
            current, self._scorer = self._scorer, None
            scorers = {s for s, n in self._borrowers.items() if n > 0}
        for scorer in scorers | ({current} if current is not None else set()):
            scorer.abandon()
        with self._changed:
            self._changed.wait_for(lambda: not any(self._borrowers.values()), timeout_s)
            return sum(self._borrowers.values())
