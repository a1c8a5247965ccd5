"""``actor_rollout_ref.actor``: training of the policy (PPO batch layout, clipping, losses,
optimizer) and its ``policy_loss``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.algorithms.registry import POLICY_LOSSES, describe
from meshrl.config.sections.base import KLEstimator, PolicyLossName, Section
from meshrl.config.sections.megatron import MegatronConfig, Strategy
from meshrl.config.sections.optim import OptimConfig

ASYNC_TIS_IMP_RATIO_CAP = 2.0
"""`actor.tis_imp_ratio_cap` when async training is on and the cap is not set: verl's
suggested truncation for its rollout-correction weights."""


class PolicyLossConfig(Section):
    loss_mode: PolicyLossName = Field(
        "vanilla",
        description="The policy objective, by its entry in meshrl/algorithms/registry.py "
        "(docs/algorithms.md has each, docs/extending.md adds one): " + describe(POLICY_LOSSES),
    )
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """clip_cov: share of a micro-batch's response tokens taken out of the loss at most
    (at least one), drawn among the candidates (seeded by trainer.seed)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a candidate's covariance (A - mean A)(log π - mean log π) is above this."""
    clip_cov_ub: float = 5.0
    """clip_cov: and below this."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """kl_cov: share of a micro-batch's response tokens penalised (at least one): those
    of largest covariance."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """kl_cov: weight of the penalty |log π - log π_old| on those tokens."""


class ActorConfig(Section):
    strategy: Strategy = "fsdp2"
    """The trainer backend: fsdp or fsdp2 (both FSDP2 `fully_shard` over world_size ranks),
    or megatron (Megatron-Core, split as `megatron` says; docs/megatron.md)."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """With strategy=megatron: tensor and pipeline parallel sizes (verl's keys)."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks (processes) behind the actor endpoint."""
    ppo_mini_batch_size: int = Field(64, gt=0)
    """Prompts per optimizer step (times rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0)
    """Responses per forward/backward (gradient accumulation over a mini-batch)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget instead of a fixed count of responses."""
    ppo_max_token_len_per_gpu: int = Field(16384, gt=0)
    """Prompt+response tokens per update micro-batch at most when `use_dynamic_bsz`
    (a longer single row gets a micro-batch of its own)."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over the rollout batch per PPO step."""
    shuffle: bool = True
    """Shuffle the batch's rows before each epoch splits them into mini-batches (seeded by
    trainer.seed and the step; verl's default is false)."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip ε; the default of clip_ratio_low / clip_ratio_high."""
    clip_ratio_low: float | None = None
    """Lower clip ε (ratio ≥ 1 - low); None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip ε (ratio ≤ 1 + high); None = clip_ratio."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add β·KL(π‖π_ref) to the actor loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """β of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the loss: kl, abs, mse, low_var_kl (add '+' for straight-through)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (counts over the whole mini-batch)."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    tis_imp_ratio_cap: float = -1.0
    """Truncated importance sampling cap on π_old/π_rollout; -1 = off. Unset with
    trainer.async_training.enable: 2 (decoupled PPO's behaviour weight)."""
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """Which policy objective (verl's `actor_rollout_ref.actor.policy_loss`)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer of the actor."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of this role's model (one graph, reused by every
    layer; FSDP2's gathers stay outside it). None: on with trainer.device=cuda (verl's
    default, true), off on the CPU, where compiling costs more than it gains."""
    param_offload: bool = False
    """Keep the float32 master weights in CPU memory between this role's calls (verl's
    `fsdp_config.param_offload`, accepted as this key): copied to the GPU when a call
    starts and back when it ends, so a co-located rollout or the other trainer has their
    GPU memory meanwhile. On trainer.device=cpu it changes nothing."""
    optimizer_offload: bool = False
    """Keep the optimizer's moments (AdamW: twice the float32 weights) in CPU memory between
    updates (verl's `fsdp_config.optimizer_offload`, accepted as this key)."""
