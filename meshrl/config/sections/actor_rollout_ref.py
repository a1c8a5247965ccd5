"""``actor_rollout_ref``: the policy's model and its three roles, actor, rollout and the
frozen reference (``ref``)."""

from __future__ import annotations

from pydantic import Field

from meshrl.config.sections.actor import ActorConfig
from meshrl.config.sections.base import Section
from meshrl.config.sections.megatron import MegatronConfig, Strategy
from meshrl.config.sections.model import ModelConfig
from meshrl.config.sections.rollout import RolloutConfig


class RefConfig(Section):
    strategy: Strategy = "fsdp2"
    """As actor.strategy, for the reference role."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """As actor.megatron, for the reference role."""
    log_prob_micro_batch_size_per_gpu: int = Field(16, gt=0)
    """Responses per forward of the frozen reference."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Reference forwards by token budget; None = actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = Field(None, gt=0)
    """Token budget of a reference forward; None = actor.ppo_max_token_len_per_gpu."""
    world_size: int = Field(1, ge=1)
    """Ranks behind the ref endpoint."""
    param_offload: bool = False
    """Keep the reference's weights in (pinned) CPU memory between its passes, copied to the
    GPU for each pass and freed after it (FSDP2's CPU offload; verl's
    ``ref.fsdp_config.param_offload``, which is accepted as this key): the GPU memory of a
    whole model stays free while the actor and critic update, for a host-to-device copy of
    the weights every step. With trainer.device=cpu they are in CPU memory anyway."""
    use_torch_compile: bool | None = None
    """torch.compile each decoder layer of the reference. None: as
    actor_rollout_ref.actor.use_torch_compile (verl's interpolation)."""


class ActorRolloutRefConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy's model: the actor trains it, the rollout generates with it, the reference
    scores with its frozen weights."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Training of the policy: PPO batch layout, clipping, losses, optimizer."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation: engine, sampling, old log-prob forwards, weight sync, validation sampling."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The frozen reference policy, run only when a KL penalty or KL loss needs it (a LoRA
    actor computes it itself, with its adapters off)."""
