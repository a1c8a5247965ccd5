"""The root's sections together (RunConfig's fields), and the properties they imply."""

from __future__ import annotations

from pydantic import Field

from meshrl.algorithms.registry import advantage_estimator
from meshrl.config.sections.actor_rollout_ref import ActorRolloutRefConfig
from meshrl.config.sections.algorithm import AlgorithmConfig
from meshrl.config.sections.base import Section
from meshrl.config.sections.critic import CriticConfig
from meshrl.config.sections.data import DataConfig
from meshrl.config.sections.launcher import LauncherConfig
from meshrl.config.sections.reward import RewardConfig
from meshrl.config.sections.security import SecurityConfig
from meshrl.config.sections.trainer import TrainerConfig


class RunSections(Section):
    """Every section of a run config, and what they say together of the roles a run starts.
    The config itself is :class:`meshrl.config.schema.RunConfig`, which fills the defaults that
    follow other keys and checks the rules of meshrl/config/rules.py."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Prompts: files, lengths, batch sizes and order."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """The policy: its model, its training (actor), generation (rollout) and reference (ref)."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model (PPO's critic); on for gae unless critic.enable says otherwise."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Scoring of responses: rule scorers or a custom function, a reward model, DAPO's
    overlong penalty."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL penalty in the reward, dynamic sampling."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Run length, validation, checkpoints, loggers, device and seeds."""
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    """How and where the role servers start."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """TLS and the shared token of the run's gRPC servers and clients."""

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return advantage_estimator(self.algorithm.adv_estimator).needs_critic

    @property
    def use_critic_server(self) -> bool:
        """A critic server is started: the run trains a critic. An evaluation
        (``trainer.val_only``) trains nothing, so it starts none, whatever the estimator."""
        return self.use_critic and not self.trainer.val_only

    @property
    def use_ref(self) -> bool:
        """The run needs reference log-probs (a KL penalty or a KL loss)."""
        return self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss

    @property
    def ref_in_actor(self) -> bool:
        """A LoRA actor computes the reference log-probs itself, with its adapters off (its
        base weights are the reference policy), as verl's ref_in_actor: no reference server
        and no second copy of the base model."""
        return self.use_ref and self.actor_rollout_ref.model.lora_rank > 0

    @property
    def use_ref_server(self) -> bool:
        """A reference server is started: the run needs reference log-probs, not from the
        LoRA actor itself, and it trains (an evaluation computes no KL)."""
        return self.use_ref and not self.ref_in_actor and not self.trainer.val_only
