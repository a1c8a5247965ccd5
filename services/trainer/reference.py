"""The reference policy: the frozen starting model, forward only (KL anchor)."""

from __future__ import annotations

import torch

from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.trainer.distributed import World
from services.trainer.forward import rollout_temperature
from services.trainer.fsdp import mixed_precision, shard_model
from services.trainer.model_loading import freeze, load_policy_model
from services.trainer.scoring import ForwardSettings, log_prob_settings, policy_log_probs
from services.trainer.sequences import SequenceBatch


class RefRole:
    name = "ref"

    def __init__(
        self, model: torch.nn.Module, temperature: float, forward: ForwardSettings, world: World
    ):
        self.model = model
        self.temperature = temperature
        self.forward = forward
        self.world = world
        self.weight_version = 0  # never changes

    @staticmethod
    def build(cfg: RunConfig, world: World) -> RefRole:
        arr = cfg.actor_rollout_ref
        model = freeze(
            load_policy_model(
                arr.model.path, world.device, remove_padding=arr.model.use_remove_padding
            )
        )
        # Frozen weights still shard: the reference is as large as the actor.
        model = shard_model(
            model,
            world.mesh,
            mixed_precision(arr.model.dtype),
            offload=arr.ref.param_offload,
        )
        return RefRole(model, rollout_temperature(cfg), log_prob_settings(cfg, arr.ref), world)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def compute_log_probs(
        self,
        batch: SequenceBatch,
        temperature: float | None = None,
        with_entropy: bool = False,
        base_model: bool = False,
    ) -> tuple[Ragged, Ragged | None]:
        """Log-probs (and entropies) of every response token under the frozen policy.
        ``base_model`` changes nothing: the reference is the base model."""
        return policy_log_probs(
            self.model,
            batch,
            temperature or self.temperature,
            with_entropy,
            self.forward,
            self.world,
        )
