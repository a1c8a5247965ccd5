"""The LM head fused with log-prob and entropy, chunk by chunk of positions.

Full float32 logits of a 16k-token micro-batch over a 152k vocabulary are 10 GB (and the
same again for their gradient). This head computes, for ``chunk_rows`` positions at a
time, ``logits = h @ W^T / T`` in float32, the log-prob of the given next token and the
entropy, and keeps nothing of the logits: each chunk is recomputed in backward
(activation checkpointing), so at most one chunk's logits exist at once.

It replaces ``model.lm_head`` in place and holds the *same* weight parameter (names and
tied embeddings unchanged), so FSDP2 shards and unshards it as before: the fused work runs
inside the model's own forward, where the weight is gathered (and cast to the mixed-
precision dtype). Without pending labels it is a plain linear layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_scores(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """h (n, hidden), labels (n,) -> (n, 2): log-prob of the label and entropy (float32).
    ``gather_logits``: ``weight`` is a block of the vocabulary's rows (tensor parallelism);
    it maps this block's logits to the whole vocabulary's."""
    logits = h @ weight.t()
    if gather_logits is not None:
        logits = gather_logits(logits)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return torch.stack([logprob, torch.zeros_like(logprob)], dim=-1)
    if entropy_grad:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    else:  # a metric only: no backward through the softmax over the vocabulary
        with torch.no_grad():
            z = logits.detach()
            entropy = lse.detach() - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return torch.stack([logprob, entropy], dim=-1)


_COMPILED: dict[str, object] = {}


def _scores_fn(device: torch.device):
    """``_chunk_scores``, compiled on CUDA: the float32 reductions over the vocabulary
    (and their backward) become a few fused kernels instead of a dozen full passes."""
    if device.type != "cuda" or _COMPILED.get("failed"):
        return _chunk_scores
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_chunk_scores, dynamic=True)
    return _COMPILED["fn"]


class ChunkedLMHead(nn.Module):
    def __init__(self, linear: nn.Linear, chunk_rows: int = 2048):
        super().__init__()
        self.weight = linear.weight  # the same Parameter: tying and names survive
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chunk_rows = chunk_rows
        # Set when ``weight`` is this rank's block of a vocabulary-parallel head: maps the
        # block's logits to the whole vocabulary's (a collective; never compiled).
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._pending: tuple[torch.Tensor, float, bool, bool] | None = None

    def expect(
        self,
        labels: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool = True,
    ) -> None:
        """Makes the next forward return scores of ``labels`` (b, k) instead of logits;
        ``entropy_grad=False`` computes the entropy as a metric (no gradient)."""
        self._pending = (labels, temperature, with_entropy, entropy_grad)

    def _chunk(self, fn, flat_h, flat_y, start, temperature, with_entropy, entropy_grad):
        h = flat_h[start : start + self.chunk_rows]
        y = flat_y[start : start + self.chunk_rows]
        args = (h, self.weight, y, temperature, with_entropy, entropy_grad)
        if self.gather_logits is not None:
            args += (self.gather_logits,)
        if torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad):
            # Recomputed in backward: only one chunk's float32 logits exist at a time.
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (b, k, h) -> logits (b, k, V), or (b, k, 2) [log-prob, entropy] after
        :meth:`expect`."""
        if self._pending is None:
            logits = nn.functional.linear(hidden, self.weight, self.bias)
            return logits if self.gather_logits is None else self.gather_logits(logits)
        labels, temperature, with_entropy, entropy_grad = self._pending
        self._pending = None
        if self.bias is not None:
            raise ValueError("ChunkedLMHead: an LM head with bias is not supported")
        b, k, _ = hidden.shape
        if b * k == 0:
            return _no_scores(hidden, self.weight)
        flat_h = hidden.reshape(b * k, -1)
        flat_y = labels.reshape(b * k)
        parts = []
        fn = _chunk_scores
        try:
            if self.gather_logits is None:
                fn = _scores_fn(flat_h.device)
            for start in range(0, b * k, self.chunk_rows):
                parts.append(
                    self._chunk(fn, flat_h, flat_y, start, temperature, with_entropy, entropy_grad)
                )
        except Exception as e:  # noqa: BLE001 - a compiler problem shows at the first call
            if fn is _chunk_scores:
                raise
            _COMPILED["failed"] = True
            warnings.warn(
                f"compiled LM-head scores failed ({e}); running them eagerly", stacklevel=2
            )
            parts = [
                self._chunk(
                    _chunk_scores, flat_h, flat_y, start, temperature, with_entropy, entropy_grad
                )
                for start in range(0, b * k, self.chunk_rows)
            ]
        # A fresh tensor, not a view: FSDP2 warns about views among module outputs.
        return torch.cat(parts).view(b, k, 2).clone()


def _no_scores(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(b, 0, h) -> (b, 0, 2): no position to score, as in a padding-free micro-batch whose
    responses are all empty. The empty result still hangs off the hidden states and the
    weight, so a backward through it reaches every FSDP unit (zero gradients): FSDP's
    reduce after backward is a collective that all ranks must join."""
    anchor = (hidden.sum() + weight.sum()).float() * 0.0  # () zero, with grad
    return anchor.expand(hidden.shape[0], hidden.shape[1], 2).clone()


def install_chunked_head(model: nn.Module, chunk_rows: int = 2048) -> ChunkedLMHead | None:
    """Swaps ``model.lm_head`` for a :class:`ChunkedLMHead` (before sharding); returns it,
    or None when the model has no plain linear LM head."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, ChunkedLMHead):
        return head
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    model.lm_head = ChunkedLMHead(head, chunk_rows)
    return model.lm_head
