"""AdamW, the learning-rate schedule, and one clipped optimizer step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from meshrl.config.sections import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    # The fused kernel updates all parameters in a few launches instead of several per
    # tensor; CUDA only (DTensor shards included).
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params,
        fused=fused,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


@dataclass(frozen=True)
class LrSchedule:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio * lr``.

    A pure function of the PPO step, so a restarted or resumed trainer needs no scheduler
    state: the coordinator sends ``global_step`` with every update. It counts the role's
    own updates, as verl's scheduler does (one step per update call): ``first_step`` is
    the PPO step of the role's first update (the actor's comes after ``critic_warmup``).
    """

    lr: float
    warmup_steps: int = 0
    kind: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    first_step: int = 1

    @staticmethod
    def from_config(
        cfg: OptimConfig, run_total_steps: int | None, first_step: int = 1
    ) -> LrSchedule:
        total = cfg.total_training_steps or run_total_steps
        if cfg.lr_scheduler_type == "cosine" and not total:
            raise ValueError(
                "lr_scheduler_type=cosine needs optim.total_training_steps "
                "or trainer.total_training_steps"
            )
        return LrSchedule(
            cfg.lr, cfg.lr_warmup_steps, cfg.lr_scheduler_type, cfg.min_lr_ratio, total, first_step
        )

    def factor(self, step: int) -> float:
        """Multiplier of ``lr`` for the update with 0-based index ``step``."""
        if step < self.warmup_steps:
            # (step + 1): the first update already learns, at lr / warmup_steps.
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None  # from_config refuses cosine without a total
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def lr_at(self, global_step: int) -> float:
        """lr of the update at 1-based PPO step ``global_step`` (verl's step counter)."""
        return self.lr * self.factor(max(0, global_step - self.first_step))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass(frozen=True)
class StepResult:
    """On the device, so a step needs no host sync; the caller reads them with its metrics."""

    grad_norm: torch.Tensor  # () global norm before clipping (over all ranks' shards)
    skipped: torch.Tensor  # () bool: the norm was inf/nan and the step was skipped


def clipped_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float
) -> StepResult:
    """Clips the global gradient norm to ``max_norm`` and steps, unless it is inf/nan.

    With FSDP2 the gradients are DTensor shards: every rank sees the same global norm
    (:func:`global_grad_norm`) and takes the same decision. The fused AdamW takes that
    decision on the device (its ``found_inf``, as with a gradient scaler); another
    optimizer needs it on the host (one sync).
    """
    with record_function("meshrl/clip_grad_norm"):
        norm = clip_grad_norm(params, max_norm)
        skipped = ~torch.isfinite(norm)
    with record_function("meshrl/adamw"):
        stepped = fused_adamw_on_local_shards(optimizer, skip=skipped)
    if not stepped and not bool(skipped):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(norm, skipped)


@torch.no_grad()
def fused_adamw_on_local_shards(
    optimizer: torch.optim.Optimizer, skip: torch.Tensor | None = None
) -> bool:
    """``optimizer.step()`` of a fused AdamW, run on the local shards of its DTensor
    parameters, gradients and moments (the same kernel, ``torch._fused_adamw_``, on the
    same numbers: every shard's update depends only on its own elements). Returns False,
    having changed nothing, when it does not apply (another optimizer, amsgrad/maximize,
    moments not created yet: the first step), and the caller steps as usual.

    ``skip`` (a () bool tensor on the parameters' device): when true the kernel changes
    nothing (its ``found_inf``) and the step counts stay, decided on the device.

    Why: dispatching the fused kernel through DTensor, for ~300 parameters and their three
    states, took ~5 ms of host time a step on the H200 while the GPU waited.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        return False
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group["amsgrad"] or group["maximize"]:
            return False
        if isinstance(group["lr"], torch.Tensor):
            return False
        tensors: tuple[list[torch.Tensor], ...] = ([], [], [], [], [])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p)
            if not state or "exp_avg" not in state:
                return False
            for bucket, t in zip(
                tensors,
                (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]),
                strict=True,
            ):
                bucket.append(_local(t))
        kinds = {(t.device, t.dtype) for t in tensors[0] + tensors[1] + tensors[2] + tensors[3]}
        if len(kinds) > 1:
            return False
        calls.append((group, tensors))
    for group, (params, grads, exp_avgs, exp_avg_sqs, steps) in calls:
        if not params:
            continue
        found_inf = None if skip is None else skip.to(params[0].device, torch.float32)
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
            found_inf=found_inf,
        )
        if found_inf is not None:  # a skipped step is not counted (as torch's AdamW does)
            torch._foreach_sub_(steps, [found_inf] * len(steps))
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    # The shard itself, as FSDP2 reads it: ``to_local()`` goes through an autograd function,
    # ~1 us of host time each, over ~1,500 tensors a step in the optimizer alone.
    return t._local_tensor if isinstance(t, DTensor) else t


# A plain-tensor parameter that is one rank's part of a tensor split over a process group
# (Megatron's tensor parallelism) carries that group under this attribute: its gradient's
# squares are summed over the group, where the other parameters' are counted once.
SPLIT_OVER = "meshrl_split_over"


def global_grad_norm(
    grads: list[torch.Tensor], split_over: list[Any] | None = None
) -> torch.Tensor:
    """The 2-norm of ``grads`` over all ranks, a float32 scalar on their device.

    Computed on the local shards (a few foreach kernels) plus one all-reduce of the sum of
    squares: ``clip_grad_norm_`` on DTensors dispatches each op through DTensor, which
    took ~10 ms of host time per step on the H200 while the GPU waited. FSDP2 shards
    every gradient along dim 0 (no replicas), so the shards' squares sum to the total.

    ``split_over``: for each gradient, the process group its parameter is split over
    (:data:`SPLIT_OVER`), or None where every rank holds the same whole gradient.
    """
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm([_local(g) for g in grads], 2.0)
    squares = torch.stack([n.float() for n in norms]).square()
    groups = split_over or [None] * len(grads)
    split = [g for g in dict.fromkeys(groups) if g is not None]
    if not split:
        total = squares.sum()
    else:  # one all-reduce per group, of its shards' squares; the replicated ones once
        total = squares[[i for i, g in enumerate(groups) if g is None]].sum()
        for group in split:
            part = squares[[i for i, g in enumerate(groups) if g is group]].sum()
            torch.distributed.all_reduce(part, group=group)
            total = total + part
    mesh = next((g.device_mesh for g in grads if isinstance(g, DTensor)), None)
    if mesh is not None and mesh.size() > 1:
        torch.distributed.all_reduce(total, group=mesh.get_group())
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scales the gradients in place so their global norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_``: factor ``max_norm / (norm + 1e-6)``, capped at 1);
    returns the norm before clipping, on the device (no host sync)."""
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad if p.grad is not None]
    split_over = [getattr(p, SPLIT_OVER, None) for p in with_grad]
    split = any(g is not None for g in split_over)
    norm = global_grad_norm(grads, split_over if split else None)
    if grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        local = [_local(g) for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].device))
    return norm
