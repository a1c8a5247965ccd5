"""What the rollout server does, apart from gRPC: the engine behind a lock, and weight syncs.

One lock serialises everything that touches the engine, so a weight swap never overlaps a
forward: ReceiveWeights waits for the Generate in flight, and a Generate that arrives during
a swap waits for it. With ``rollout.partial_rollout`` a running Generate lends the engine to
the swap at its next token boundary instead (``engine_lock.py``), and goes on under the new
weights. Failures are typed exceptions; ``server.py`` maps them to status codes.

Stopping: `close` refuses new calls. A generation whose RPC was cancelled (the server
cancels the calls still running after its grace period) stops at the engine's next check;
a weight sync blocked on its peer cannot be interrupted, so the server exits without
joining it; `wait_for_generations` tells it whether any call is left.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from meshrl.config import RunConfig
from meshrl.config.roles import role_settings
from meshrl.ragged import Ragged
from meshrl.rpc.call_count import CallCount
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.engine import IntakeFailed, RolloutEngine, WeightIntake
from services.rollout.engine_lock import EngineLock
from services.rollout.registry import build_engine
from services.rollout.types import GenerationResult, SamplingParams, TokenScores

log = logging.getLogger(__name__)


class NotInitializedError(RuntimeError):
    """A call that needs the model came before Initialize."""


class NoWeightGroupError(RuntimeError):
    """ReceiveWeights without a joined group, or with a manifest for another group."""


class WeightSyncError(RuntimeError):
    """A sync failed half-way (peer died, timeout, bad manifest); the group is closed."""


class ShuttingDownError(RuntimeError):
    """A call that came once the server had begun to stop."""


@dataclass(frozen=True)
class SyncStats:
    version: int
    """Weight version served after the sync."""
    seconds: float
    """Wall time of receiving and loading."""
    bytes: int
    """Bytes received."""


class RolloutWorker:
    """Owns the engine (once initialized) and the current weight-sync group."""

    def __init__(self) -> None:
        self._engine: RolloutEngine | None = None
        self.model_path = ""
        self._engine_lock = EngineLock()  # generation, scoring and swaps never overlap
        self._partial_rollout = False  # a Generate lends the engine to a swap mid-call
        self._group: WeightIntake | None = None
        self._group_lock = threading.Lock()  # taken before _engine_lock, never after
        self._calls = CallCount(lambda name: ShuttingDownError("rollout server is shutting down"))
        # Generations among them: the ones a stopping server waits for, as they stop at the
        # engine's next check once their RPCs are cancelled (the others cannot stop).
        self._generations = CallCount(lambda name: ShuttingDownError(name))

    def _call(self):
        """Counts one call while it runs; refuses it once `close` was called."""
        return self._calls.admit("rollout call")

    @property
    def running(self) -> int:
        """Calls (generation, scoring, loading, weight syncs) still running."""
        return self._calls.running

    def wait_for_generations(self, timeout_s: float) -> int:
        """Waits up to `timeout_s` for the generations running to end; returns the calls of
        any kind still running then."""
        self._generations.wait_idle(timeout_s)
        return self.running

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            raise NotInitializedError("rollout not initialized: call Initialize")
        return self._engine

    def initialize(self, cfg: RunConfig) -> None:
        with self._call():
            settings = role_settings(cfg, "rollout")
            engine = build_engine(cfg)  # slow: load outside the lock, swap in under it
            with self._engine_lock.hold():
                self._engine = engine
                self.model_path = settings.model_path
                self._partial_rollout = settings.section.partial_rollout

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
    ) -> GenerationResult:
        """``cancelled``: set when the caller is gone; the engine then stops at its next
        check, and a call that waited for the lock behind another does not start. With
        partial rollouts the engine lends itself to a weight swap at its token boundaries."""
        with self._call(), self._generations.admit("generate"), self._engine_lock.hold():
            lend = self._engine_lock if self._partial_rollout else None
            return self.engine.generate(prompts, params, cancelled, lend)

    def score(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> tuple[TokenScores, int]:
        """Per-token scores and the weight version that computed them."""
        with self._call(), self._engine_lock.hold():
            engine = self.engine
            return engine.score(
                prompts, responses, temperature, with_entropy
            ), engine.weight_version

    def set_memory(self, release: bool) -> int:
        """Releases or resumes the engine's memory; returns the KV cache bytes held after."""
        with self._call(), self._engine_lock.hold():
            engine = self.engine
            engine.release_memory() if release else engine.resume_memory()
            return engine.kv_cache_bytes

    # --- weight sync ---

    def join_group(self, spec: GroupSpec) -> str:
        """Joins a (new) weight-sync group, closing the previous one; blocks until all joined.
        The engine joins it its own way (in this process, or in its worker process)."""
        with self._call(), self._group_lock:
            self._close_group()
            self._group = self.engine.join_weight_group(spec)
            return spec.group_id

    def receive(self, manifest: WeightManifest) -> SyncStats:
        """Receives the manifest's buckets and swaps them into the engine.

        On failure the group is closed (the coordinator forms a new one) and the engine's
        weight version becomes -1 if some tensors were already loaded: the weights are then
        a mix of two versions and need a full re-sync.
        """
        with self._call(), self._group_lock:
            intake = self._current_group(manifest)
            start = time.monotonic()
            try:
                received = intake.receive(manifest, self._engine_lock.borrow())
            except Exception as e:
                self._close_group()
                why = str(e) if isinstance(e, IntakeFailed) else f"({type(e).__name__}: {e})"
                log.warning(
                    "weight sync v%d failed %s; group %s closed", manifest.version, why,
                    intake.group_id,
                )  # fmt: skip
                raise WeightSyncError(
                    f"weight sync to version {manifest.version} failed {why}; group "
                    f"{intake.group_id} closed, weight version now {self.engine.weight_version}"
                ) from e
            seconds = time.monotonic() - start
        log.info(
            "weights v%d: %d tensors, %.1f MB in %.2fs",
            manifest.version,
            received.tensors,
            received.bytes / 1e6,
            seconds,
        )
        return SyncStats(manifest.version, seconds, received.bytes)

    def close(self) -> None:
        """Refuses new calls and closes the weight group, without waiting for the calls still
        running (see `running`). A sync or join in progress holds the group: it is left to
        the process's exit, which drops its connections (its peer then fails), rather than
        waiting up to the group's timeout for it here."""
        self._calls.close()
        if self._group_lock.acquire(blocking=False):
            try:
                self._close_group()
            finally:
                self._group_lock.release()

    def _current_group(self, manifest: WeightManifest) -> WeightIntake:
        if self._group is None:
            raise NoWeightGroupError("no weight-sync group: call JoinWeightGroup first")
        if manifest.group_id and manifest.group_id != self._group.group_id:
            raise NoWeightGroupError(
                f"manifest is for weight group {manifest.group_id}, "
                f"but this server is in group {self._group.group_id}"
            )
        return self._group

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()
