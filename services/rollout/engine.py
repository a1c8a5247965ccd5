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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

import torch

from meshrl.ragged import Ragged

if TYPE_CHECKING:
    from meshrl.weight_sync.types import GroupSpec, WeightManifest

FinishReason = Literal["stop", "length"]


class MemoryReleasedError(RuntimeError):
    """The engine's memory was released for a co-located trainer; resume it first."""


class GenerationCancelled(RuntimeError):
    """A generation's caller is gone (its RPC was cancelled, ran past its deadline, or the
    server is stopping): the engine stopped at its next check and returns nothing."""


def check_cancelled(cancelled: threading.Event | None, steps: int) -> None:
    """Raises GenerationCancelled once `cancelled` is set; `steps`: decode steps so far."""
    if cancelled is not None and cancelled.is_set():
        raise GenerationCancelled(f"generation cancelled after {steps} decode steps")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; one set for the whole request.

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` == 1 switch those filters off.
    The same ``seed`` with the same weights and request gives the same tokens; ``None``
    draws a fresh seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # The messages name the proto fields, so a bad request says what to fix.
        if self.n < 1:
            raise ValueError(f"sampling.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are computed at: 1 for greedy, else the sampling one."""
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class GenerationResult:
    """B*n responses of one generate call; sample j of prompt i is at index ``i*n + j``."""

    responses: Ragged
    """int64 token ids; a stop/EOS token that ended a response is its last token."""
    logprobs: Ragged
    """float32 ``log_softmax(logits / T)`` at each response token, aligned with ``responses``."""
    finish_reasons: list[FinishReason]
    """One per response: "stop" (EOS or a stop token sampled) or "length" (max_tokens)."""
    weight_version: int
    """The weights that produced every response."""


class TokenScores(NamedTuple):
    """Per-token scores of given responses, each aligned with the responses' ids."""

    logprobs: Ragged
    """float32 ``log_softmax(logits / T)`` at each response token."""
    entropy: Ragged | None
    """float32 entropy of ``softmax(logits / T)`` at each response position, if asked."""


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
    ) -> GenerationResult:
        """Samples ``params.n`` responses for each of the B prompts. Once ``cancelled`` is
        set, stops at the engine's next check (a decode step, or a round of them) with
        GenerationCancelled; an engine that cannot stop half-way checks it before starting."""
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
        worker's engine lock: no generation meanwhile) for as short a time as the transport
        allows. On success the engine serves ``manifest.version`` with its prefix cache
        dropped; on failure it raises :class:`IntakeFailed` and leaves ``weight_version``
        -1 if the weights may be a mix of two versions."""
        ...

    def close(self) -> None: ...
