"""What one role server reads of the run config: :func:`role_settings`.

Every role server is sent the whole resolved config at Initialize (one message for all,
written once by the coordinator); each reads its own section, and the few keys it shares
with the run, through this one function, so that what a role depends on is said here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar, overload

from meshrl.config.sections import (
    ActorConfig,
    CriticConfig,
    ModelConfig,
    MultiTurnConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
)

if TYPE_CHECKING:
    from meshrl.config.schema import RunConfig

Role = Literal["actor", "critic", "ref", "rollout", "reward", "env"]
ROLES: tuple[Role, ...] = ("actor", "critic", "ref", "rollout", "reward", "env")

TRAINED = (ActorConfig, CriticConfig, RefConfig)
RoleSection = (
    ActorConfig | CriticConfig | RefConfig | RolloutConfig | RewardConfig | MultiTurnConfig
)
S = TypeVar("S", bound=RoleSection)


@dataclass(frozen=True)
class RoleSettings(Generic[S]):
    """One role's section and the keys of the run it shares."""

    role: Role
    section: S
    """Its own section: ``actor_rollout_ref.actor``, ``critic``, ``actor_rollout_ref.ref``,
    ``actor_rollout_ref.rollout``, ``reward``, or ``actor_rollout_ref.rollout.multi_turn``
    for the environment server."""
    model: ModelConfig | None
    """The model section it loads: the policy's (``actor_rollout_ref.model``) for actor,
    ref, rollout and env (its tokenizer), ``critic.model`` for the critic; None for reward,
    whose model is in its section."""
    model_path: str
    """The model folder (or hub id) it loads: the critic's falls back to the actor's; the
    reward model's when it is on, else empty."""
    tokenizer_path: str
    """The tokenizer folder (or hub id) of that model: its ``tokenizer_path``, else
    ``model_path``."""
    world_size: int
    """Ranks behind its endpoint: the trainer roles' ``world_size``; 1 for the others (each
    rollout replica is a server of its own)."""
    device: str
    """``trainer.device``: where the rollout and trainer roles compute."""
    max_sequence_length: int
    """``data.max_prompt_length + data.max_response_length``: the longest prompt and
    response it is sent."""


@overload
def role_settings(cfg: RunConfig, role: Literal["actor"]) -> RoleSettings[ActorConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: Literal["critic"]) -> RoleSettings[CriticConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: Literal["ref"]) -> RoleSettings[RefConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: Literal["rollout"]) -> RoleSettings[RolloutConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: Literal["reward"]) -> RoleSettings[RewardConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: Literal["env"]) -> RoleSettings[MultiTurnConfig]: ...
@overload
def role_settings(cfg: RunConfig, role: str) -> RoleSettings[RoleSection]: ...
def role_settings(cfg: RunConfig, role: str) -> RoleSettings:
    """``role``'s settings in ``cfg``; ValueError for a role the config has no section of."""
    policy = cfg.actor_rollout_ref
    sections: dict[str, RoleSection] = {
        "actor": policy.actor,
        "critic": cfg.critic,
        "ref": policy.ref,
        "rollout": policy.rollout,
        "reward": cfg.reward,
        "env": policy.rollout.multi_turn,
    }
    if role not in sections:
        raise ValueError(f"no settings for role {role!r} (one of {', '.join(ROLES)})")
    section = sections[role]
    model: ModelConfig | None = policy.model
    model_path = policy.model.path
    if role == "critic":
        model, model_path = cfg.critic.model, cfg.critic.model.path or policy.model.path
    elif role == "reward":
        rm = cfg.reward.reward_model
        model, model_path = None, rm.path if rm.enable else ""
    return RoleSettings(
        role=role,  # type: ignore[arg-type]  # one of ROLES: checked above
        section=section,
        model=model,
        model_path=model_path,
        tokenizer_path=(model.tokenizer_path if model is not None else None) or model_path,
        world_size=section.world_size if isinstance(section, TRAINED) else 1,
        device=cfg.trainer.device,
        max_sequence_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
    )
