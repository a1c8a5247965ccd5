"""Partial rollouts with ``partial_rollout_kv=recompute``: after a weight swap mid-call, the
keys/values of every running slot are computed again under the new weights.

A running slot holds its prompt and the tokens generated so far but the last one (which the
next decode step feeds, at ``positions``); those are prefilled again into the same slot,
right-padded as an admit's prompts are (the padding's keys/values land past the slot's
position, where decode steps write before they read).
"""

from __future__ import annotations

import torch

from meshrl.ragged import Ragged
from services.rollout.fast.decoder import StaticDecoder
from services.rollout.fast.kv_cache import KVView
from services.rollout.fast.scheduler import Scheduler
from services.rollout.fast.slots import SlotState


def recompute_running_slots(
    decoder: StaticDecoder,
    kv: KVView,
    state: SlotState,
    sched: Scheduler,
    prompts: Ragged,
    budget_tokens: int,
) -> int:
    """Prefills each running, unfinished slot's prompt + tokens so far (but the last) into
    its slot under the weights now loaded, at most ``budget_tokens`` padded tokens a
    forward; returns how many slots were recomputed."""
    # The swap paused the call: one copy of the slots' state to the host is cheap next to it.
    done, gen_len, tokens = state.done.cpu(), state.gen_len.cpu(), state.tokens.cpu()
    slots = [s for s in sched.active if not done[s]]
    rows = []
    for slot in slots:
        prompt = prompts.row(sched.slot_seq[slot] // sched.n).to(torch.int64)
        rows.append(torch.cat([prompt, tokens[slot, : int(gen_len[slot]) - 1]]))
    for chunk in _by_budget(list(range(len(rows))), [len(r) for r in rows], budget_tokens):
        batch = Ragged.from_tensors([rows[i] for i in chunk])
        ids = batch.to_padded(pad_value=0)[0].long().to(kv.k.device)  # (m, L)
        lengths = batch.lengths.to(kv.k.device)  # (m,)
        dest = torch.tensor([slots[i] for i in chunk], device=kv.k.device)
        src = torch.arange(len(chunk), device=kv.k.device)
        decoder.prefill(ids, lengths, kv.k, kv.v, dest, src)  # logits unused
    return len(slots)


def _by_budget(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Groups of items whose padded size (count x longest) fits ``budget``."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for item in items:
        longest_with = max(longest, lengths[item])
        if current and (len(current) + 1) * longest_with > budget:
            chunks.append(current)
            current, longest_with = [], lengths[item]
        current.append(item)
        longest = longest_with
    if current:
        chunks.append(current)
    return chunks
