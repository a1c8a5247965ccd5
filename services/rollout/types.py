"""The rollout service's typed values: what a generation asks for and what it returns.

Used on both sides of the gRPC edge (``convert.py`` maps them to and from protos): by the
engines and the server, and by ``client.py`` for the coordinator and users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from meshrl.ragged import Ragged

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; one set for the whole request.

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` == 1 switch those filters off.
    The same ``seed`` with the same weights and request gives the same tokens; ``None``
    draws a fresh seed. ``logprobs=False``: the caller uses no sampling log-probs, and an
    engine that computes them only on request (vLLM) returns NaN in their place.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: bool = True

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
    """The weights that produced the responses' last tokens (every token, unless a weight
    update landed mid-generation: ``token_versions``)."""
    token_versions: Ragged | None = None
    """int64 weight version of each response token, aligned with ``responses``, when a weight
    update landed during the generation (``rollout.partial_rollout``); None: every token
    is of ``weight_version``."""


class TokenScores(NamedTuple):
    """Per-token scores of given responses, each aligned with the responses' ids."""

    logprobs: Ragged
    """float32 ``log_softmax(logits / T)`` at each response token."""
    entropy: Ragged | None
    """float32 entropy of ``softmax(logits / T)`` at each response position, if asked."""
