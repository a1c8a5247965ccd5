"""Tool calls in separate worker processes, each under a time limit, in a worker whose
memory is capped and which can write no file and start no process.

A call that runs past its time is killed with its worker (pebble starts a fresh one); a
worker that dies (a crash, the memory limit's kill) costs that call alone. Either comes
back as a :class:`ToolFailed` with the reason, never as an error of the server.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pebble import ProcessExpired, ProcessPool

from services.env import sandbox_process

DEFAULT_MEMORY_LIMIT_MB = 512


class ToolFailed(Exception):
    """A tool call that timed out or whose worker died; the message says which."""


class Sandbox:
    """``num_workers`` spawned worker processes under ``memory_limit_mb`` each."""

    def __init__(self, num_workers: int = 2, memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB):
        self.memory_limit_mb = memory_limit_mb
        self._pool = ProcessPool(
            max_workers=num_workers,
            initializer=sandbox_process.limit_worker,
            initargs=(memory_limit_mb,),
            context=multiprocessing.get_context("spawn"),
        )

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)`` in a worker; ToolFailed when it outlives ``timeout_s`` (counted from
        when a worker takes it) or its worker dies. ``fn`` must be importable by name."""
        future = self._pool.schedule(fn, args=args, timeout=timeout_s)
        try:
            return future.result()
        except FutureTimeout:
            raise ToolFailed(
                f"the tool ran past its limit of {timeout_s:g}s and was stopped"
            ) from None
        except ProcessExpired as e:
            raise ToolFailed(f"the tool's process died (exit code {e.exitcode})") from None
        except MemoryError:
            raise ToolFailed(
                f"the tool ran out of its {self.memory_limit_mb} MB of memory"
            ) from None

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=5)
