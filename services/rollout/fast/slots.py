"""Per-slot decoding state, all on the device: what each slot feeds next, what it made.

A slot holds one sequence from its prefill until it finishes; then the scheduler hands it
to a waiting sequence. Every update here is a tensor op on the device, so a decode step
never waits for the host; the host reads ``done`` only every few steps.

A finished slot keeps stepping until the host sees it (its outputs are not touched:
writes go to column ``gen_len``, past its tokens, and ``gen_len`` stops growing).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def record_step(
    out_tokens: torch.Tensor,
    out_logprobs: torch.Tensor,
    gen_len: torch.Tensor,
    done: torch.Tensor,
    stopped: torch.Tensor,
    last_tokens: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    stop_ids: torch.Tensor,
    max_tokens: int,
    last_position: int,
) -> None:
    """One sampled token for each of the first bs slots, in place: tokens, logprobs (bs,)
    into column ``gen_len`` of out_tokens/out_logprobs (S, max_tokens + 1); the lengths,
    stop flags, next inputs and positions (S,) advance for slots not yet done."""
    bs = tokens.shape[0]
    alive = ~done[:bs]
    rows = torch.arange(bs, device=tokens.device)
    gen = gen_len[:bs]
    out_tokens[rows, gen] = tokens
    out_logprobs[rows, gen] = logprobs
    gen += alive
    hit = alive & torch.isin(tokens, stop_ids)
    stopped[:bs] |= hit
    done[:bs] |= hit | (gen >= max_tokens)
    last_tokens[:bs] = tokens
    positions[:bs] = (positions[:bs] + alive).clamp_(max=last_position)


_compiled: dict[str, object] = {}


def _record_fn(device: torch.device):
    """On CUDA, :func:`record_step` compiled into a few kernels instead of about fifteen
    (each a launch of its own every decode step); eager elsewhere or if compiling failed."""
    if device.type != "cuda" or _compiled.get("failed"):
        return record_step
    if "record" not in _compiled:
        _compiled["record"] = torch.compile(record_step, dynamic=True)
    return _compiled["record"]


class SlotState:
    def __init__(self, slots: int, max_tokens: int, slot_len: int, device: torch.device):
        self.max_tokens = max_tokens
        self.slot_len = slot_len
        z: dict[str, Any] = dict(device=device)
        self.last_tokens = torch.zeros(slots, dtype=torch.int64, **z)
        """(S,) the token each slot feeds next."""
        self.positions = torch.zeros(slots, dtype=torch.int64, **z)
        """(S,) position of ``last_tokens`` in its slot."""
        self.gen_len = torch.zeros(slots, dtype=torch.int64, **z)
        """(S,) tokens generated so far."""
        self.done = torch.ones(slots, dtype=torch.bool, **z)
        """(S,) finished, or holding no sequence."""
        self.stopped = torch.zeros(slots, dtype=torch.bool, **z)
        """(S,) finished by a stop token (else by max_tokens)."""
        # One spare column: finished slots write their junk there.
        self.tokens = torch.zeros(slots, max_tokens + 1, dtype=torch.int64, **z)
        self.logprobs = torch.zeros(slots, max_tokens + 1, dtype=torch.float32, **z)

    def admit(
        self,
        slots: torch.Tensor,
        prompt_lengths: torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        stop_ids: torch.Tensor,
    ) -> None:
        """Starts sequences in ``slots`` (m,) with their prompts' lengths (m,) and the first
        sampled tokens/log-probs (m,)."""
        self.last_tokens[slots] = tokens
        self.positions[slots] = prompt_lengths
        self.gen_len[slots] = 1
        self.tokens[slots, 0] = tokens
        self.logprobs[slots, 0] = logprobs
        hit = torch.isin(tokens, stop_ids)
        self.stopped[slots] = hit
        self.done[slots] = hit | (self.max_tokens <= 1)

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """Takes one sampled token for each of the first bs slots: tokens, logprobs (bs,)."""
        args = (
            self.tokens,
            self.logprobs,
            self.gen_len,
            self.done,
            self.stopped,
            self.last_tokens,
            self.positions,
            tokens,
            logprobs,
            stop_ids,
            self.max_tokens,
            self.slot_len - 1,
        )
        fn = _record_fn(tokens.device)
        if fn is record_step:
            return record_step(*args)
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a compiler problem shows at the first call
            # A compiler failure shows before the compiled code runs: nothing was written yet.
            log.warning("compiled slot bookkeeping failed (%s); running it eagerly", e)
            _compiled["failed"] = True
            record_step(*args)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves the state of slots ``src`` to ``dst`` (m,) (compaction); src left done."""
        for t in (
            self.last_tokens,
            self.positions,
            self.gen_len,
            self.stopped,
            self.tokens,
            self.logprobs,
        ):
            t[dst] = t[src]
        done = self.done[src]
        self.done[src] = True
        self.done[dst] = done
