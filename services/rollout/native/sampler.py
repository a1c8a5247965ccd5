"""Picks the next token from logits: temperature, top-k, top-p, seeded, without a host sync.

The log-prob returned for a token is ``log_softmax(logits / T)`` of the *unfiltered*
distribution (T = 1 for greedy), in float32: exactly what the trainer recomputes from a
full forward, so rollout and trainer log-probs can be compared token by token. top-k and
top-p only shape which token is drawn.
"""

from __future__ import annotations

import torch

from meshrl.algorithms.entropy import logprobs_from_logits
from services.rollout.types import SamplingParams


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs.

    logits: (b, v), any float dtype. Returns tokens (b,) int64 and logprobs (b,) float32.
    """
    scaled = logits.float() / params.logprob_temperature  # (b, v)
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        filtered = top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)
        tokens = _draw(filtered.softmax(dim=-1), generator)
    return tokens, logprobs_from_logits(scaled, tokens)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Sets all but the k largest logits of each row to -inf; k <= 0 or >= v is a no-op."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (b, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches p (nucleus sampling,
    Holtzman et al. 2019); the most likely token always stays."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (b, v)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the mass before it already reaches p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (b, v), with no device-to-host sync.

    argmax(p / E) with E ~ Exp(1) draws index i with probability p_i (the "exponential race",
    equivalent to the Gumbel-max trick); unlike torch.multinomial it never syncs.
    """
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # A float32 draw can round to 0; 0/0 = NaN would let a filtered-out token win argmax.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)
