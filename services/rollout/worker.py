"""What the rollout server does, apart from gRPC: the engine behind a lock, and weight syncs.

One lock serialises everything that touches the engine, so a weight swap never overlaps a
generation: ReceiveWeights waits for the Generate in flight, and a Generate that arrives
during a swap waits for it. Failures are typed exceptions; ``server.py`` maps them to
status codes.

Stopping: `close` refuses new calls. A generation whose RPC was cancelled (the server
cancels the calls still running after its grace period) stops at the engine's next check;
a weight sync blocked on its peer cannot be interrupted, so the server exits without
joining it; `wait_for_generations` tells it whether any call is left.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from meshrl.config import RunConfig
from meshrl.ragged import Ragged
from meshrl.rpc.call_count import CallCount
from meshrl.weight_sync.group import WeightGroup
from meshrl.weight_sync.receiver import WeightReceiver
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.engine import (
    GenerationResult,
    GroupMemberEngine,
    RolloutEngine,
    SamplingParams,
    TokenScores,
)

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


def build_engine(cfg: RunConfig) -> RolloutEngine:
    """The engine the run config asks for, loaded and ready."""
    model = cfg.actor_rollout_ref.model
    rollout = cfg.actor_rollout_ref.rollout
    if not model.path or not Path(model.path).is_dir():
        raise ValueError(f"actor_rollout_ref.model.path={model.path!r} is not a model folder")
    if rollout.name == "vllm":
        from services.rollout.vllm_engine import VllmEngine  # vllm imported inside, lazily

        return VllmEngine(
            model.path,
            tokenizer_path=model.tokenizer_path,
            dtype=rollout.dtype,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enforce_eager=rollout.enforce_eager,
            max_num_seqs=rollout.max_num_seqs,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        )
    from services.rollout.native_engine import NativeEngine  # torch + transformers: heavy

    max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    kwargs = dict(
        tokenizer_path=model.tokenizer_path,
        dtype=rollout.dtype,
        device="cuda" if cfg.trainer.device == "cuda" else "cpu",
        max_num_seqs=rollout.max_num_seqs,
        logprob_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
    )
    if kwargs["device"] == "cuda":
        # On a GPU: the static-cache engine (CUDA graphs unless enforce_eager) when it knows
        # the architecture; the plain engine otherwise.
        from services.rollout.fast_engine import FastEngine, fast_path_reason

        reason = fast_path_reason(model.path)
        if reason is None:
            return FastEngine(
                model.path,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                enforce_eager=rollout.enforce_eager,
                max_model_len=max_model_len,
                **kwargs,
            )
        log.warning("rollout fast path off (%s): using the plain engine", reason)
    return NativeEngine(model.path, max_model_len=max_model_len, **kwargs)


class RolloutWorker:
    """Owns the engine (once initialized) and the current weight-sync group."""

    def __init__(self) -> None:
        self._engine: RolloutEngine | None = None
        self.model_path = ""
        self._engine_lock = threading.Lock()  # generation, scoring and swaps never overlap
        self._group: WeightGroup | _EngineGroup | None = None
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
            engine = build_engine(cfg)  # slow: load outside the lock, swap in under it
            with self._engine_lock:
                self._engine = engine
                self.model_path = cfg.actor_rollout_ref.model.path

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
    ) -> GenerationResult:
        """``cancelled``: set when the caller is gone; the engine then stops at its next
        check, and a call that waited for the lock behind another does not start."""
        with self._call(), self._generations.admit("generate"), self._engine_lock:
            return self.engine.generate(prompts, params, cancelled)

    def score(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> tuple[TokenScores, int]:
        """Per-token scores and the weight version that computed them."""
        with self._call(), self._engine_lock:
            engine = self.engine
            return engine.score(
                prompts, responses, temperature, with_entropy
            ), engine.weight_version

    def set_memory(self, release: bool) -> int:
        """Releases or resumes the engine's memory; returns the KV cache bytes held after."""
        with self._call(), self._engine_lock:
            engine = self.engine
            engine.release_memory() if release else engine.resume_memory()
            return engine.kv_cache_bytes

    # --- weight sync ---

    def join_group(self, spec: GroupSpec) -> str:
        """Joins a (new) weight-sync group, closing the previous one; blocks until all joined."""
        with self._call(), self._group_lock:
            self._close_group()
            engine = self._engine
            if isinstance(engine, GroupMemberEngine):
                engine.join_weight_group(spec)  # vLLM: its worker process is the member
                self._group = _EngineGroup(spec.group_id, engine)
            elif spec.transport == "cuda_ipc":  # the actor's GPU is ours: open its buffers
                from meshrl.weight_sync.cuda_ipc import IpcGroup

                self._group = IpcGroup.join(spec)
            else:
                self._group = WeightGroup.join(spec)
            return spec.group_id

    def receive(self, manifest: WeightManifest) -> SyncStats:
        """Receives the manifest's buckets and swaps them into the engine.

        On failure the group is closed (the coordinator forms a new one) and the engine's
        weight version becomes -1 if some tensors were already loaded: the weights are then
        a mix of two versions and need a full re-sync.
        """
        with self._call(), self._group_lock:
            group = self._current_group(manifest)
            if isinstance(group, _EngineGroup):
                return self._receive_in_engine(group, manifest)
            start = time.monotonic()
            stream = None
            if manifest.ipc_handles:  # cuda_ipc: views of the actor's ring buffers
                pairs = group.receive(manifest)
            else:  # gloo/nccl: buckets may land straight in the engine's weights
                stream = pairs = WeightReceiver(group, manifest, _weight_targets(self.engine))
            received = _Counted(pairs)
            try:
                # Generation goes on until the actor starts sending: only the swap pauses it,
                # and an actor that never sends does not stall the rollout.
                if stream is not None:
                    stream.wait_for_sender()  # its header only: nothing written yet
                else:
                    received.wait_for_first()
                with self._engine_lock:
                    self._swap(manifest, received, stream)
            except Exception as e:
                self._close_group()
                log.warning(
                    "weight sync v%d failed after %d tensors: %s; group %s closed",
                    manifest.version, received.tensors, e, group.group_id,
                )  # fmt: skip
                raise WeightSyncError(
                    f"weight sync to version {manifest.version} failed after "
                    f"{received.tensors} of {len(manifest.param_names)} tensors "
                    f"({type(e).__name__}: {e}); group {group.group_id} closed, weight "
                    f"version now {self.engine.weight_version}"
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

    def _swap(
        self, manifest: WeightManifest, received: _Counted, stream: WeightReceiver | None
    ) -> None:
        """Under the engine lock: loads every tensor, drops cached prefixes, sets the version.
        A failure once weights were touched leaves version -1 (two versions mixed)."""
        engine = self.engine
        try:
            engine.load_weights(received)
            if received.tensors != len(manifest.param_names):
                raise ValueError(
                    f"the engine took {received.tensors} of the "
                    f"{len(manifest.param_names)} tensors of the manifest"
                )
        except Exception:
            if received.tensors or (stream is not None and stream.wrote_targets):
                engine.weight_version = -1
            raise
        engine.reset_prefix_cache()
        engine.weight_version = manifest.version

    def _receive_in_engine(self, group: _EngineGroup, manifest: WeightManifest) -> SyncStats:
        """The engine's own worker receives and loads (vLLM); paused generation throughout."""
        start = time.monotonic()
        with self._engine_lock:
            engine = self.engine
            try:
                engine.receive_weights(manifest)
            except Exception as e:
                self._close_group()
                engine.weight_version = -1  # how far the engine got is not known here
                raise WeightSyncError(
                    f"weight sync to version {manifest.version} failed in the engine "
                    f"({type(e).__name__}: {e}); group {group.group_id} closed, weight version -1"
                ) from e
            engine.reset_prefix_cache()
            engine.weight_version = manifest.version
        return SyncStats(manifest.version, time.monotonic() - start, manifest.nbytes)

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

    def _current_group(self, manifest: WeightManifest) -> WeightGroup | _EngineGroup:
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


def _weight_targets(engine: RolloutEngine) -> dict[str, torch.Tensor] | None:
    """The engine's own tensors, if it lets a sync receive into them (the native engine)."""
    targets = getattr(engine, "weight_targets", None)
    return targets() if callable(targets) else None


@dataclass(frozen=True)
class _EngineGroup:
    """The group as seen from here when the engine's own process is its member."""

    group_id: str
    engine: GroupMemberEngine

    def close(self) -> None:
        try:
            self.engine.close_weight_group()
        except Exception as e:  # noqa: BLE001 - a broken engine may refuse; the group is gone
            log.warning("closing weight group %s in the engine: %s", self.group_id, e)


class _Counted(Iterable[tuple[str, torch.Tensor]]):
    """Passes (name, tensor) pairs through, counting those the consumer has taken in."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]]):
        self._pairs = pairs
        self._first: list[tuple[str, torch.Tensor]] = []
        self.tensors = 0
        self.bytes = 0

    def wait_for_first(self) -> None:
        """Blocks until the first pair has arrived (kept for the consumer)."""
        self._first = [pair for pair in itertools.islice(self._pairs, 1)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in itertools.chain(self._first, self._pairs):
            yield name, tensor
            # Resumed: the consumer has loaded this tensor and asks for the next one.
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
