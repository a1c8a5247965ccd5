"""Wall-clock timing of the PPO phases under verl's names (`timing_s/gen`, ...)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per phase; thread-safe so parallel phases time themselves."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        """Counts time spent elsewhere (another thread, an earlier step) under ``phase``."""
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}
