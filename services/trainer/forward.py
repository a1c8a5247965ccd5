"""One forward pass of a role model over a micro-batch, reduced to response tokens.

The micro-batch is either right-padded rows (``sequences.PackedSequences``) or one
padding-free row (``padding_free.FlatSequences``); both give the model's keyword
arguments, the positions to keep, and a map of outputs back to ``(b, r)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from meshrl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from meshrl.config.schema import RunConfig
from services.trainer.chunked_head import ChunkedLMHead
from services.trainer.padding_free import ModelBatch


class TokenScores(NamedTuple):
    logprobs: torch.Tensor  # (b, r) float32 log pi(token | prefix) at temperature
    entropy: torch.Tensor | None  # (b, r) float32 entropy of pi at that position


def response_logprobs(
    model: nn.Module,
    packed: ModelBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> TokenScores:
    """Log-probs (and entropy) of every response token under ``softmax(logits / T)``.

    Only the trailing positions that predict response tokens get logits
    (``logits_to_keep``), which skips the LM head over most of a long prompt.
    ``entropy_grad=False`` computes the entropy from detached logits (a metric only).
    """
    head = getattr(model, "lm_head", None)
    if isinstance(head, ChunkedLMHead):
        return _chunked_scores(model, head, packed, temperature, with_entropy, entropy_grad)
    out = model(**packed.model_inputs(), logits_to_keep=packed.logits_to_keep, use_cache=False)
    logits = packed.at_responses(out.logits)  # (b, r, V)
    if temperature != 1.0:
        logits = logits / temperature  # as the sampler did: same T as the rollout
    logprobs = logprobs_from_logits(logits, packed.response_ids).float()
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach()).float()
    return TokenScores(logprobs, entropy)


def _chunked_scores(
    model: nn.Module,
    head: ChunkedLMHead,
    packed: ModelBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> TokenScores:
    """The same scores through the fused head: no (b, k, V) logits ever exist at once."""
    head.expect(packed.kept_labels(), temperature, with_entropy, entropy_grad)
    out = model(**packed.model_inputs(), logits_to_keep=packed.logits_to_keep, use_cache=False)
    scores = packed.at_responses(out.logits)  # (b, r, 2)
    entropy = None
    if with_entropy:
        entropy = scores[..., 1] if entropy_grad else scores[..., 1].detach()
    return TokenScores(scores[..., 0], entropy)


def response_values(model: nn.Module, packed: ModelBatch) -> torch.Tensor:
    """(b, r) critic values: for response token j, the value at the position before it
    (the state from which token j was chosen), as verl's ``values[:, -r - 1 : -1]``."""
    values = model(**packed.model_inputs())  # (b, t), or (1, T) padding-free
    return packed.at_responses(values)


def rollout_temperature(cfg: RunConfig) -> float:
    """The sampler's temperature, which the trainer's log-probs must use too (as verl
    does); 0 (greedy) has no sampling distribution to match, so logits stay unscaled."""
    t = cfg.actor_rollout_ref.rollout.temperature
    return t if t > 0 else 1.0
