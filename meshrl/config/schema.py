"""The run config: typed, validated at start, every field documented.

Keys follow verl's names where they mean the same thing, so a verl user finds
`data.train_batch_size`, `actor_rollout_ref.actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`
where they expect them. Unknown keys are errors (``extra="forbid"``). Values found at run
time (ports, addresses, versions) live in state objects, never in this config.

This module is the root, :class:`RunConfig`: its sections, the defaults that follow other
keys, and what the run starts. Each section is a module of meshrl/config/sections/; the
rules that read several keys are meshrl/config/rules.py; what one role server reads of it,
meshrl/config/roles.py.
"""

from __future__ import annotations

from pydantic import model_validator

from meshrl.config.rules import config_problems
from meshrl.config.sections import ASYNC_TIS_IMP_RATIO_CAP
from meshrl.config.sections.run import RunSections


class RunConfig(RunSections):
    """The run config: its sections (:class:`RunSections`), the defaults that follow other keys,
    and the rules of meshrl/config/rules.py checked as it is built."""

    @model_validator(mode="after")
    def _critic_mini_batch_defaults_to_the_actors(self) -> RunConfig:
        if self.critic.ppo_mini_batch_size is None:  # verl's ${actor...ppo_mini_batch_size}
            self.critic.ppo_mini_batch_size = self.actor_rollout_ref.actor.ppo_mini_batch_size
        return self

    @model_validator(mode="after")
    def _defaults_follow_the_device(self) -> RunConfig:
        model, rollout = self.actor_rollout_ref.model, self.actor_rollout_ref.rollout
        if model.dtype is None:  # bf16 compute over float32 masters on a GPU, as verl's
            model.dtype = "bfloat16" if self.trainer.device == "cuda" else "float32"
        if rollout.dtype is None:
            rollout.dtype = model.dtype
        on_gpu = self.trainer.device == "cuda"
        actor, critic, ref = self.actor_rollout_ref.actor, self.critic, self.actor_rollout_ref.ref
        # verl's defaults are true; on the CPU compiling and recomputing only cost time
        for m in (model, critic.model):
            if m.enable_gradient_checkpointing is None:
                m.enable_gradient_checkpointing = on_gpu
        for role in (actor, critic):
            if role.use_torch_compile is None:
                role.use_torch_compile = on_gpu
        if ref.use_torch_compile is None:
            ref.use_torch_compile = actor.use_torch_compile
        return self

    @model_validator(mode="after")
    def _async_training_weighs_the_behaviour_policy(self) -> RunConfig:
        # Decoupled PPO (Hilton et al. 2022; AReaL): in async mode the samples come from
        # older policies, so the importance weight behaviour -> proximal is on by default.
        actor = self.actor_rollout_ref.actor
        if self.trainer.async_training.enable and "tis_imp_ratio_cap" not in (
            actor.model_fields_set
        ):
            actor.tis_imp_ratio_cap = ASYNC_TIS_IMP_RATIO_CAP
        return self

    @model_validator(mode="after")
    def _check_rules(self) -> RunConfig:
        # after the defaults above; every problem in one message (a line each), not one per
        # attempt
        if problems := config_problems(self, "load"):
            raise ValueError("\n  ".join(problems))
        return self
