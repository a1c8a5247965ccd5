"""The rollout engine interface and the typed containers that cross it.

The server talks to an engine only through :class:`RolloutEngine`, so the plain torch
engine (``native/``), the CUDA-graph engine (``fast/``) and vLLM (``vllm/``) are
interchangeable behind the same gRPC API; ``registry.py`` builds the one ``rollout.name``
asks for. Each engine owns its weight intake (:class:`WeightIntake`): the rollout worker hands
it the group's spec and each manifest, and never looks inside. Token batches are
:class:`~meshrl.ragged.Ragged` (flat ids + offsets), never padded.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from meshrl.ragged import Ragged

if TYPE_CHECKING:
    from meshrl.weight_sync.types import GroupSpec, WeightManifest
    from services.rollout.types import GenerationResult, SamplingParams, TokenScores


class MemoryReleasedError(RuntimeError):
    """The engine's memory was released for a co-located trainer; resume it first."""


class GenerationCancelled(RuntimeError):
    """A generation's caller is gone (its RPC was cancelled, ran past its deadline, or the
    server is stopping): the engine stopped at its next check and returns nothing."""


class WeightsMixedError(RuntimeError):
    """A weight sync that landed during a generation (partial rollouts) failed half-way: the
    weights are a mix of two versions, so the generation stops rather than go on with them."""


KVAfterSwap = Literal["keep", "recompute"]
"""What partial rollouts do with the KV cache of the unfinished sequences at a weight swap
(``rollout.partial_rollout_kv``): keep it (computed under the old weights), or recompute it
under the new weights (a prefill of each sequence's prompt and tokens so far)."""


class TokenBoundary(Protocol):
    """What a generation sees, at its token boundaries, of the lock that serialises it with
    weight swaps (``engine_lock.EngineLock``; partial rollouts)."""

    @property
    def swap_waiting(self) -> bool:
        """A weight swap waits for the engine (an engine that must prepare first, as vLLM's
        aborting its requests, does so before it lends)."""
        ...

    def lend_if_asked(self) -> bool:
        """Lends the engine to the waiting swaps and waits until they are done; True when one
        ran (the weights may have changed: read ``weight_version`` again)."""
        ...


def check_cancelled(cancelled: threading.Event | None, steps: int) -> None:
    """Raises GenerationCancelled once `cancelled` is set; `steps`: decode steps so far."""
    if cancelled is not None and cancelled.is_set():
        raise GenerationCancelled(f"generation cancelled after {steps} decode steps")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout server needs from a generation engine."""

    weight_version: int
    """Version of the weights served: 0 as loaded from disk, the sync's after each sync,
    -1 when unknown (a sync failed half-way)."""

    @property
    def num_parameters(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the model lives (and where received weights should land)."""
        ...

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the engine holds for its KV cache between calls."""
        ...

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
        at_token_boundary: TokenBoundary | None = None,
    ) -> GenerationResult:
        """Samples ``params.n`` responses for each of the B prompts. Once ``cancelled`` is
        set, stops at the engine's next check (a decode step, or a round of them) with
        GenerationCancelled; an engine that cannot stop half-way checks it before starting.

        ``at_token_boundary`` (partial rollouts): between decode steps the engine lends itself
        to a waiting weight swap through it; the unfinished responses go on under the new
        weights, each token's version in ``GenerationResult.token_versions``. A swap that
        failed half-way (version -1) stops the call with WeightsMixedError."""
        ...

    def compute_logprobs(self, prompts: Ragged, responses: Ragged, temperature: float) -> Ragged:
        """float32 log-probs of each response token given its prompt, as the trainer computes them."""
        ...

    def score(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> TokenScores:
        """Log-probs (and optionally entropy) of each response token in one forward."""
        ...

    def release_memory(self) -> None:
        """Frees what a co-located trainer needs (the KV cache); generate and score raise
        :class:`MemoryReleasedError` until :meth:`resume_memory`."""
        ...

    def resume_memory(self) -> None: ...

    def reset_prefix_cache(self) -> None:
        """Drops cached prompt prefixes, which are stale after a weight swap."""
        ...

    def join_weight_group(self, spec: GroupSpec) -> WeightIntake:
        """Joins a formation of the weight-sync group as ``spec.rank`` (blocks until every
        member joined) and returns the intake that receives its syncs."""
        ...


class ReceivedWeights(NamedTuple):
    """What one sync took in."""

    tensors: int
    bytes: int


class IntakeFailed(RuntimeError):
    """A sync failed in an engine's intake; ``progress`` says how far it got (for example
    "after 3 of 10 tensors"), ``cause`` why. The worker closes the group and reports both."""

    def __init__(self, progress: str, cause: BaseException):
        super().__init__(f"{progress} ({type(cause).__name__}: {cause})")
        self.progress = progress
        self.cause = cause


@runtime_checkable
class WeightIntake(Protocol):
    """An engine's membership of one formation of the weight-sync group (gloo, NCCL or CUDA
    IPC; see docs/weight_sync.md). Made by :meth:`RolloutEngine.join_weight_group`."""

    @property
    def group_id(self) -> str: ...

    def receive(
        self, manifest: WeightManifest, exclusive: AbstractContextManager
    ) -> ReceivedWeights:
        """Receives the manifest's buckets and swaps them in, holding ``exclusive`` (the
        worker's engine, borrowed: no forward meanwhile; with partial rollouts a running
        generation lends it at a token boundary and waits there) for as short a time as the
        transport allows. On success the engine serves ``manifest.version`` with its prefix cache
        dropped; on failure it raises :class:`IntakeFailed` and leaves ``weight_version``
        -1 if the weights may be a mix of two versions."""
        ...

    def close(self) -> None: ...
