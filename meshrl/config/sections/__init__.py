"""The run config's sections, one module each (the root, RunConfig, is meshrl/config/schema.py):

- ``base``: the Section base and the value types several sections share
- ``data``: ``data``
- ``model``, ``optim``: a model section and an optimizer section (actor, critic)
- ``actor``, ``rollout``, ``actor_rollout_ref``: ``actor_rollout_ref`` and its roles (the
  reference's section is in ``actor_rollout_ref``)
- ``critic``, ``reward``, ``algorithm``, ``trainer``, ``launcher``, ``security``
- ``run``: all of them together (RunConfig's fields) and the properties they imply
"""

from meshrl.config.sections.actor import ASYNC_TIS_IMP_RATIO_CAP, ActorConfig, PolicyLossConfig
from meshrl.config.sections.actor_rollout_ref import ActorRolloutRefConfig, RefConfig
from meshrl.config.sections.algorithm import AlgorithmConfig, FilterGroupsConfig, KLCtrlConfig
from meshrl.config.sections.base import FileList, KLEstimator, OneOrList, PathText, Section
from meshrl.config.sections.critic import CriticConfig
from meshrl.config.sections.data import DataConfig
from meshrl.config.sections.launcher import LAUNCHER_ROLES, LauncherConfig, ResourcePoolConfig
from meshrl.config.sections.model import ModelConfig
from meshrl.config.sections.optim import OptimConfig
from meshrl.config.sections.reward import OverlongBufferConfig, RewardConfig, RewardModelConfig
from meshrl.config.sections.rollout import (
    MultiTurnConfig,
    RolloutConfig,
    ValKwargs,
    WeightSyncConfig,
)
from meshrl.config.sections.run import RunSections
from meshrl.config.sections.security import SecurityConfig
from meshrl.config.sections.trainer import AsyncTrainingConfig, TrainerConfig

__all__ = [
    "ASYNC_TIS_IMP_RATIO_CAP",
    "LAUNCHER_ROLES",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "CriticConfig",
    "DataConfig",
    "FileList",
    "FilterGroupsConfig",
    "KLCtrlConfig",
    "KLEstimator",
    "LauncherConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OneOrList",
    "OptimConfig",
    "OverlongBufferConfig",
    "PathText",
    "PolicyLossConfig",
    "RefConfig",
    "ResourcePoolConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunSections",
    "SecurityConfig",
    "Section",
    "TrainerConfig",
    "ValKwargs",
    "WeightSyncConfig",
]
