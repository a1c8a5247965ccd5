"""Forward-only passes over a whole batch (log-probs, values), data-parallel over ranks.

Each rank scores its share of the rows in micro-batches; the per-token results are put
back in their rows of a ``(b, r)`` tensor that is zero elsewhere, and one all-reduce sum
gives every rank the whole batch (adding zeros is exact).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshrl.ragged import Ragged
from services.trainer.distributed import World
from services.trainer.forward import response_logprobs
from services.trainer.micro_batches import plan_epoch
from services.trainer.sequences import PackedSequences, SequenceBatch, pack_sequences

# Maps a packed micro-batch to one or more (m, r) per-response-token tensors.
ScoreFn = Callable[[PackedSequences], tuple[torch.Tensor, ...]]


@torch.no_grad()
def score_batch(
    batch: SequenceBatch, micro_batch_rows: int, score: ScoreFn, world: World
) -> list[Ragged]:
    """Runs ``score`` over the batch; returns each output as flat values aligned with
    ``batch.responses.values``."""
    lengths = batch.response_lengths
    width = int(lengths.max())
    (plan,) = plan_epoch(
        lengths, len(batch), micro_batch_rows, rank=world.rank, world_size=world.world_size
    )
    outputs: list[torch.Tensor] | None = None
    for micro in plan.micro_batches:
        packed = pack_sequences(batch.select(micro.rows), response_width=width).to(world.device)
        results = score(packed)
        if outputs is None:
            outputs = [torch.zeros(len(batch), width) for _ in results]
        if micro.weight:
            mask = packed.response_mask.cpu()
            for out, result in zip(outputs, results, strict=True):
                out[micro.rows] = torch.where(mask, result.float().cpu(), 0.0)
    for out in outputs:
        world.all_reduce_sum(out)
    return [Ragged.from_padded(out, lengths) for out in outputs]


def policy_log_probs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    temperature: float,
    with_entropy: bool,
    micro_batch_rows: int,
    world: World,
) -> tuple[Ragged, Ragged | None]:
    """Log-probs (and entropies) of a policy model's response tokens; actor and ref."""

    def score(packed: PackedSequences) -> tuple[torch.Tensor, ...]:
        logprobs, entropy = response_logprobs(model, packed, temperature, with_entropy)
        return (logprobs,) if entropy is None else (logprobs, entropy)

    was_training = model.training
    model.eval()  # no dropout: scores must be deterministic
    try:
        outputs = score_batch(batch, micro_batch_rows, score, world)
    finally:
        model.train(was_training)
    return outputs[0], outputs[1] if with_entropy else None
