"""Forward-only passes over a whole batch (log-probs, values), data-parallel over ranks.

Each rank scores its share of the rows in micro-batches; the per-token results are put
back in their rows of a ``(b, r)`` tensor that is zero elsewhere, and one all-reduce sum
gives every rank the whole batch (adding zeros is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshrl.config.schema import RunConfig
from meshrl.config.sections import RefConfig, RolloutConfig
from meshrl.ragged import Ragged
from services.trainer.distributed import World
from services.trainer.forward import response_logprobs
from services.trainer.fsdp.sharding import resharded
from services.trainer.micro_batches import plan_epoch
from services.trainer.padding_free import ModelBatch, pack_micro_batch
from services.trainer.types import SequenceBatch

# Maps a packed micro-batch to one or more (m, r) per-response-token tensors.
ScoreFn = Callable[[ModelBatch], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class ForwardSettings:
    """How a forward-only pass splits the batch and lays out each micro-batch."""

    micro_batch_rows: int  # rows per forward (log_prob_micro_batch_size_per_gpu)
    max_tokens: int | None = None  # token budget per forward instead (*_use_dynamic_bsz)
    padding_free: bool = False  # one padding-free row per forward (model.use_remove_padding)


@torch.no_grad()
def score_batch(
    batch: SequenceBatch, settings: ForwardSettings, score: ScoreFn, world: World
) -> list[Ragged]:
    """Runs ``score`` over the batch; returns each output as flat values aligned with
    ``batch.responses.values``."""
    lengths = batch.response_lengths
    width = int(lengths.max())
    (plan,) = plan_epoch(
        lengths,
        len(batch),
        settings.micro_batch_rows,
        rank=world.rank,
        world_size=world.world_size,
        max_tokens=settings.max_tokens,
        sequence_lengths=batch.prompts.lengths + lengths,
    )
    outputs: list[torch.Tensor] | None = None
    for micro in plan.micro_batches:
        rows = batch.select(micro.rows)
        packed = pack_micro_batch(rows, settings.padding_free, width).to(world.device)
        results = score(packed)
        if outputs is None:
            outputs = [torch.zeros(len(batch), width) for _ in results]
        if micro.weight:
            mask = packed.response_mask.cpu()
            for out, result in zip(outputs, results, strict=True):
                out[micro.rows] = torch.where(mask, result.float().cpu(), 0.0)
    assert outputs is not None  # every rank runs at least one micro-batch (plan_epoch)
    for out in outputs:
        world.all_reduce_sum(out)
    return [Ragged.from_padded(out, lengths) for out in outputs]


def policy_log_probs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: float,
    with_entropy: bool,
    settings: ForwardSettings,
    world: World,
    keep_gathered: bool = False,
) -> tuple[Ragged, Ragged | None]:
    """Log-probs (and entropies) of a policy model's response tokens; actor and ref.
    ``keep_gathered``: see :func:`~services.trainer.fsdp.sharding.resharded` (the actor, whose
    update follows; not the reference, which never updates)."""

    def score(packed: ModelBatch) -> tuple[torch.Tensor, ...]:
        logprobs, entropy = response_logprobs(model, packed, temperature, with_entropy)
        return (logprobs,) if entropy is None else (logprobs, entropy)

    was_training = model.training
    model.eval()  # no dropout: scores must be deterministic
    try:
        with resharded(model, keep=keep_gathered):
            outputs = score_batch(batch, settings, score, world)
    finally:
        model.train(was_training)
    return outputs[0], outputs[1] if with_entropy else None


def log_prob_settings(cfg: RunConfig, section: RolloutConfig | RefConfig) -> ForwardSettings:
    """Forward-only passes of a policy model, from ``actor_rollout_ref.rollout`` (old
    log-probs) or ``actor_rollout_ref.ref``; unset keys default to the actor's, as verl's."""
    arr = cfg.actor_rollout_ref
    dynamic = section.log_prob_use_dynamic_bsz
    if dynamic is None:
        dynamic = arr.actor.use_dynamic_bsz
    budget = section.log_prob_max_token_len_per_gpu or arr.actor.ppo_max_token_len_per_gpu
    return ForwardSettings(
        micro_batch_rows=section.log_prob_micro_batch_size_per_gpu,
        max_tokens=budget if dynamic else None,
        padding_free=arr.model.use_remove_padding,
    )
