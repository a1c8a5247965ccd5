"""Scorer worker processes: every sample runs in one, under its own timeout.

A scorer that raises, hangs, returns a non-number (or NaN), or kills its worker costs that
sample only (score 0, ok=False, the reason recorded), never the batch or the service: pebble
kills a worker whose task runs past its timeout and starts a fresh one.

Several threads (the server's concurrent Score calls) may submit at once: pebble's queue is
thread-safe, and a sample's timeout counts from when a worker takes it, so waiting behind
other calls' samples never eats into it.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from services.reward import scorer_process
from services.reward.scorers.custom import CustomFunctionError
from services.reward.types import CANCELLED_REASON, ScoreItem, ScoreOutcome, failed

log = logging.getLogger(__name__)

DEFAULT_MEMORY_LIMIT_MB = 4096


class ScorerPool:
    """`num_workers` spawned processes scoring samples with a per-sample timeout."""

    def __init__(self, num_workers: int = 2, memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB):
        self.num_workers = num_workers
        self.memory_limit_mb = memory_limit_mb
        self._pool = self._new_pool()
        # Guards the three below: scheduling, replacing a broken pool (once) and abandoning.
        self._lock = threading.Lock()
        self._in_flight: set[Future] = set()  # samples queued or being scored
        self._abandoned = False

    def _new_pool(self) -> ProcessPool:
        return ProcessPool(
            max_workers=self.num_workers,
            initializer=scorer_process.init_worker,
            initargs=(self.memory_limit_mb,),
            context=multiprocessing.get_context("spawn"),
        )

    def warm_up(self, timeout_s: float = 120.0) -> float:
        """Starts the workers (each loads the scorers in its initializer); returns the seconds
        it took."""
        t0 = time.monotonic()
        # One task per worker; the first ones taken wait on their workers' start-up.
        futures = [
            self._pool.schedule(scorer_process.warm_up, timeout=timeout_s)
            for _ in range(self.num_workers)
        ]
        for f in futures:
            f.result()
        return time.monotonic() - t0

    def check_custom(self, spec: str, timeout_s: float = 60.0) -> None:
        """Loads a custom function in a worker; CustomFunctionError with the worker's reason
        if it fails (the spec names nothing loadable, or the module raised or hung)."""
        future = self._pool.schedule(scorer_process.check_custom, args=(spec,), timeout=timeout_s)
        try:
            future.result()
        except CustomFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's module failed to import
            raise CustomFunctionError(
                f"reward.custom_function {spec}: {_reason(e, timeout_s)}"
            ) from None

    def submit(
        self,
        items: list[ScoreItem],
        timeout_s: float,
        custom_function: str | None = None,
        rule_options: dict[str, dict[str, Any]] | None = None,
    ) -> list[Future]:
        """Starts scoring `items`; `collect` waits for them. `rule_options`: keyword
        arguments per scorer family (``scorer_process.score_sample``)."""
        return [
            self._schedule(
                scorer_process.score_sample,
                (
                    it.data_source,
                    it.response,
                    it.ground_truth,
                    it.extra_info,
                    custom_function,
                    rule_options,
                ),
                timeout_s,
            )
            for it in items
        ]

    def _schedule(self, fn, args: tuple, timeout_s: float) -> Future:
        with self._lock:
            if self._abandoned:
                future: Future = Future()
                future.cancel()
                return future
            try:
                future = self._pool.schedule(fn, args=args, timeout=timeout_s)
            except RuntimeError:
                # A pool whose workers all died (e.g. at start, under a memory limit below
                # what Python needs) is broken for good; start over, so one bad call doesn't
                # end the service.
                log.warning("scorer pool is broken; starting a new one")
                self._pool.stop()
                self._pool = self._new_pool()
                future = self._pool.schedule(fn, args=args, timeout=timeout_s)
            self._in_flight.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def collect(self, futures: list[Future], timeout_s: float) -> list[ScoreOutcome]:
        """One outcome per future, same order; failures become ok=False outcomes."""
        return [_outcome(f, timeout_s) for f in futures]

    def score(
        self,
        items: list[ScoreItem],
        timeout_s: float,
        custom_function: str | None = None,
        rule_options: dict[str, dict[str, Any]] | None = None,
    ) -> list[ScoreOutcome]:
        return self.collect(self.submit(items, timeout_s, custom_function, rule_options), timeout_s)

    @staticmethod
    def cancel(futures: list[Future]) -> None:
        """Cancels the samples of `futures` not scored yet (a worker scoring one is ended
        and replaced); their outcomes become failures. Done ones are left as they are."""
        for future in futures:
            future.cancel()

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)

    def abandon(self) -> None:
        """Stops now, for a server that is stopping: the samples queued or being scored are
        cancelled (their calls get failed outcomes at once instead of waiting out a hung
        scorer's timeout), the workers are ended, and later samples are cancelled too.

        Stopping the pool alone would not do: pebble leaves the futures of the tasks it
        drops unresolved, so their calls would wait for them for ever."""
        with self._lock:
            self._abandoned = True
            in_flight = list(self._in_flight)
        self.cancel(in_flight)
        self.close()


def _outcome(future, timeout_s: float) -> ScoreOutcome:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - every failure is this sample's only
        return failed(_reason(e, timeout_s))


def _reason(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, FutureTimeout):
        return f"timeout after {timeout_s:.1f}s"
    if isinstance(e, CancelledError):
        return CANCELLED_REASON
    if isinstance(e, ProcessExpired):
        return f"worker died (exit code {e.exitcode})"
    if isinstance(e, (scorer_process.BadScore, scorer_process.ScorerError)):  # already "what: why"
        return str(e)
    return f"{type(e).__name__}: {e}"
