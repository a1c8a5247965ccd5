"""``critic``: the value model (PPO's critic), its batch layout and optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.sections.base import Section
from meshrl.config.sections.megatron import MegatronConfig, Strategy
from meshrl.config.sections.model import ModelConfig
from meshrl.config.sections.optim import OptimConfig


class CriticConfig(Section):
    enable: bool | None = None
    """None = on exactly when the advantage estimator is gae."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Empty path = start from the actor's model with a fresh value head."""
    strategy: Strategy = "fsdp2"
    """As actor.strategy, for the critic."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """As actor.megatron, for the critic."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks (processes) behind the critic endpoint."""
    ppo_mini_batch_size: int | None = Field(None, gt=0)
    """Prompts per critic optimizer step; None = the actor's (as verl's interpolation)."""
    ppo_micro_batch_size_per_gpu: int = Field(8, gt=0)
    """Responses per forward/backward of a critic update, and per value forward (without
    `use_dynamic_bsz`)."""
    use_dynamic_bsz: bool | None = None
    """Critic micro-batches by token budget; None = actor_rollout_ref.actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = Field(32768, gt=0)
    """Prompt+response tokens per critic update micro-batch when `use_dynamic_bsz`."""
    forward_max_token_len_per_gpu: int | None = Field(None, gt=0)
    """Token budget of a value forward; None = ppo_max_token_len_per_gpu."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes of the critic over the rollout batch per PPO step."""
    shuffle: bool = True
    """Shuffle the batch's rows before each epoch splits them into mini-batches (seeded by
    trainer.seed and the step; verl's default is false)."""
    cliprange_value: float = Field(0.5, gt=0)
    """Value clip around the old values."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token value losses become one number, as the actor's (counts over the whole
    mini-batch; T of seq-mean-token-sum-norm is data.max_response_length)."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm of the critic; a step whose norm is not finite is skipped."""
    critic_warmup: int = Field(0, ge=0)
    """PPO steps that train only the critic before the actor starts."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the critic; its lr defaults to 1e-5 (the actor's to 1e-6)."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of this role's model (one graph, reused by every
    layer; FSDP2's gathers stay outside it). None: on with trainer.device=cuda (verl's
    default for the actor, true), off on the CPU, where compiling costs more than it gains."""
    param_offload: bool = False
    """Keep the float32 master weights in CPU memory between this role's calls (verl's
    `fsdp_config.param_offload`, accepted as this key): copied to the GPU when a call
    starts and back when it ends, so a co-located rollout or the other trainer has their
    GPU memory meanwhile. On trainer.device=cpu it changes nothing."""
    optimizer_offload: bool = False
    """Keep the optimizer's moments (AdamW: twice the float32 weights) in CPU memory between
    updates (verl's `fsdp_config.optimizer_offload`, accepted as this key)."""
