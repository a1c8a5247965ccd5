"""The PPO update schedule shared by actor and critic: epochs x mini-batches (one
optimizer step each) x micro-batches (gradient accumulation), data-parallel over ranks.

The role supplies only the loss of one micro-batch. Its metric contributions must already
be scaled so that their sum over micro-batches and ranks is the mini-batch's value (e.g. a
token mean times this micro-batch's share of the mini-batch's tokens); they are summed over
ranks once per mini-batch and averaged over mini-batches and epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from services.trainer.distributed import World
from services.trainer.fsdp.sharding import gathered_across_steps, keeps_gathered
from services.trainer.micro_batches import MicroBatch, MiniBatch, epoch_seed, plan_epoch
from services.trainer.optim import LrSchedule, clipped_step, set_lr

# (micro-batch, its mini-batch) -> (loss to back-propagate, metric contributions)
MicroLoss = Callable[[MicroBatch, MiniBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class UpdateSettings:
    mini_batch_rows: int  # rows per optimizer step (ppo_mini_batch_size * rollout.n)
    micro_batch_rows: int  # rows per forward/backward on one rank
    epochs: int
    shuffle: bool
    grad_clip: float
    seed: int  # base of the per-step, per-epoch shuffle seed
    max_tokens: int | None = None  # token budget of a micro-batch instead (use_dynamic_bsz)


def run_update(
    response_lengths: torch.Tensor,
    settings: UpdateSettings,
    global_step: int,
    micro_loss: MicroLoss,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: LrSchedule,
    world: World,
    prefix: str,
    sequence_lengths: torch.Tensor | None = None,
) -> dict[str, float]:
    """Trains on one batch; returns metrics (``{prefix}/grad_norm``, ``{prefix}/lr``, and
    the role's own) averaged over the optimizer steps.

    ``sequence_lengths`` ``(b,)`` prompt+response tokens of every row: what a token budget
    (``settings.max_tokens``) packs by."""
    lr = schedule.lr_at(global_step)
    set_lr(optimizer, lr)
    # The optimizer's (sharded float32) parameters: while the model is gathered, its
    # parameters() are the compute-dtype copies, which hold no gradient after backward.
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    minis = [
        mini
        for epoch in range(settings.epochs)
        for mini in plan_epoch(
            response_lengths,
            settings.mini_batch_rows,
            settings.micro_batch_rows,
            shuffle=settings.shuffle,
            seed=epoch_seed(settings.seed, global_step, epoch),
            rank=world.rank,
            world_size=world.world_size,
            max_tokens=settings.max_tokens,
            sequence_lengths=sequence_lengths,
        )
    ]
    # Each step's metrics stay on the device until the update ends: one host read for the
    # whole update, so the host queues the next mini-batch while the GPU runs this one.
    steps: list[tuple[list[str], torch.Tensor]] = []
    with gathered_across_steps(model, keeps_gathered(world.world_size)) as refresh_gathered:
        for i, mini in enumerate(minis):
            names, sums = _accumulate_gradients(mini, micro_loss, world)
            with record_function("meshrl/optimizer_step"):
                step = clipped_step(params, optimizer, settings.grad_clip)
            if i + 1 < len(minis):  # the last step's weights are freed, not used
                refresh_gathered()
            norm, skipped = step.grad_norm.float().view(1), step.skipped.float().view(1)
            steps.append((names, torch.cat([sums.to(norm.device), norm, skipped])))
    # Read after the gathered weights are freed: that host work overlaps the GPU's last step.
    read = torch.stack([v for _, v in steps]).tolist() if steps else []
    per_step = []
    for (names, _), (*sums_read, grad_norm, skipped) in zip(steps, read, strict=True):
        metrics = dict(zip(names, sums_read, strict=True))
        metrics[f"{prefix}/grad_norm"] = grad_norm
        metrics[f"{prefix}/nonfinite_grad_steps"] = skipped
        per_step.append(metrics)
    out = _average(per_step)
    out[f"{prefix}/nonfinite_grad_steps"] *= len(per_step)  # a count, not a mean
    out[f"{prefix}/lr"] = lr
    return out


def _accumulate_gradients(
    mini: MiniBatch, micro_loss: MicroLoss, world: World
) -> tuple[list[str], torch.Tensor]:
    """Forward and backward of every micro-batch; returns the metrics' names and their sums
    over the ranks, (len(names),) float32 on the device."""
    sums: dict[str, torch.Tensor] = {}
    for micro in mini.micro_batches:
        with record_function("meshrl/micro_loss"):  # named ranges in profiler traces
            loss, metrics = micro_loss(micro, mini)
        # FSDP averages gradients over ranks, but each rank's loss is already divided by
        # the counts of the whole mini-batch: multiplying by the world size turns that
        # average back into the sum, which is the single-rank gradient.
        with record_function("meshrl/backward"):
            (loss * (micro.weight * world.world_size)).backward()
        # Summed where they are: a host copy per metric would stall the device queue
        # between micro-batches. One transfer per mini-batch, after the optimizer step.
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value.detach().float() * micro.weight
    names = sorted(sums)
    if not names:
        return [], torch.zeros(0)
    return names, world.all_reduce_sum(torch.stack([sums[n] for n in names]))


def _average(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys() if rows else []
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}
