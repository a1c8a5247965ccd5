"""The open episodes of a server: many at once, each stepped under a time limit.

A step that raises or runs past its limit ends its episode with an error in its result;
the other episodes of the call, and the server, go on. (A step past its limit keeps its
thread until it returns; the calculator's calls cannot outlive their own sandbox limit.)
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from services.env.environment import Environment
from services.env.types import (
    EnvironmentSpec,
    EnvReply,
    EpisodeAction,
    EpisodeStarted,
    EpisodeTask,
    StepResult,
)


class UnknownEnvironment(ValueError):
    """A task names an environment the server does not run (INVALID_ARGUMENT)."""


class EpisodeTable:
    """Episodes by id, with their environment and state."""

    def __init__(
        self,
        environments: dict[str, Environment],
        encode: Callable[[str], list[int]] | None = None,
        default_timeout_s: float = 30.0,
        max_workers: int = 16,
    ):
        """``encode``: text -> the run's token ids (None: observations as text alone)."""
        self.environments = environments
        self.encode = encode
        self.default_timeout_s = default_timeout_s
        self._episodes: dict[str, tuple[Environment, Any]] = {}
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="env-step")

    def specs(self) -> list[EnvironmentSpec]:
        return [EnvironmentSpec(name, list(env.tools)) for name, env in self.environments.items()]

    def __len__(self) -> int:
        return len(self._episodes)

    def reset(self, tasks: list[EpisodeTask]) -> list[EpisodeStarted]:
        """Starts one episode per task; UnknownEnvironment (nothing started) for a bad name,
        ValueError for a task its environment cannot start."""
        for task in tasks:
            if task.environment not in self.environments:
                known = ", ".join(sorted(self.environments))
                raise UnknownEnvironment(
                    f"no environment named {task.environment!r} (this server runs: {known})"
                )
        started = []
        for task in tasks:
            env = self.environments[task.environment]
            state = env.start(task)
            episode_id = uuid.uuid4().hex
            with self._lock:
                self._episodes[episode_id] = (env, state)
            started.append(EpisodeStarted(episode_id, list(env.tools)))
        return started

    def step(
        self, actions: list[EpisodeAction], timeout_s: float | None = None
    ) -> list[StepResult]:
        """One step of each episode, side by side; one result per action, in order."""
        limit = timeout_s or self.default_timeout_s
        futures = [self._threads.submit(self._step_one, a) for a in actions]
        wait(futures, timeout=limit)
        results = []
        for action, future in zip(actions, futures, strict=True):
            if not future.done():
                self.close([action.episode_id])
                error = f"the environment's step ran past its limit of {limit:g}s"
                results.append(StepResult(action.episode_id, done=True, error=error))
            else:
                results.append(future.result())
        return results

    def _step_one(self, action: EpisodeAction) -> StepResult:
        with self._lock:
            entry = self._episodes.get(action.episode_id)
        if entry is None:
            return StepResult(action.episode_id, done=True, error="no open episode with this id")
        env, state = entry
        try:
            reply: EnvReply = env.step(state, action)
        except Exception as e:  # noqa: BLE001 - the episode's failure, not the server's
            self.close([action.episode_id])
            return StepResult(
                action.episode_id,
                done=True,
                error=f"{env.name} step failed: {type(e).__name__}: {e}",
            )
        if reply.done:
            self.close([action.episode_id])
        ids = self.encode(reply.text) if self.encode is not None and reply.text else []
        return StepResult(action.episode_id, reply.text, ids, reply.reward, reply.done)

    def close(self, episode_ids: list[str]) -> int:
        """Drops the episodes named; how many were open."""
        with self._lock:
            return sum(self._episodes.pop(i, None) is not None for i in episode_ids)

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
