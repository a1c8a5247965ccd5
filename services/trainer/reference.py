"""The reference policy: the frozen starting model, forward only (KL anchor)."""

from __future__ import annotations

import torch

from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.trainer.backends import TrainerBackend, trainer_backend
from services.trainer.distributed import World
from services.trainer.forward import rollout_temperature
from services.trainer.scoring import ForwardSettings, log_prob_settings, policy_log_probs
from services.trainer.trained_role import full_parameter_count
from services.trainer.types import SequenceBatch


class RefRole:
    name = "ref"

    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float,
        forward: ForwardSettings,
        world: World,
        offload: bool = False,
        backend: TrainerBackend | None = None,
    ):
        """``backend``: the one that built ``model`` (None: FSDP2's)."""
        self.backend = backend or trainer_backend("fsdp2")
        self.model = model
        self.temperature = temperature
        self.forward = forward
        self.world = world
        self.update_count = 0  # never updated
        self.offload = offload  # weights in CPU memory between passes (ref.param_offload)

    @staticmethod
    def build(cfg: RunConfig, world: World) -> RefRole:
        arr = cfg.actor_rollout_ref
        backend = trainer_backend(arr.ref.strategy)
        model = backend.policy_model(cfg, world, trained=False)
        offload = arr.ref.param_offload and world.device.type == "cuda"
        settings = log_prob_settings(cfg, arr.ref)
        data = backend.data_world(model, world)
        role = RefRole(model, rollout_temperature(cfg), settings, data, offload, backend)
        role.release_gpu_memory()  # the weights passed through the GPU on their way to it
        return role

    def release_gpu_memory(self) -> None:
        """With its weights offloaded, gives the GPU blocks they (or a pass's gathered copy)
        took back to the device: the caching allocator would keep them reserved for this
        process, and the actor and critic beside it would gain nothing."""
        if self.offload:
            # Blocks last used on FSDP2's copy stream stay cached until the device has
            # finished with them: wait for it, or empty_cache keeps them.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @property
    def num_parameters(self) -> int:
        return full_parameter_count(self.backend, self.model)

    def compute_log_probs(
        self,
        batch: SequenceBatch,
        temperature: float | None = None,
        with_entropy: bool = False,
        base_model: bool = False,
    ) -> tuple[Ragged, Ragged | None]:
        """Log-probs (and entropies) of every response token under the frozen policy.
        ``base_model`` changes nothing: the reference is the base model."""
        try:
            return policy_log_probs(
                self.model,
                batch,
                temperature or self.temperature,
                with_entropy,
                self.forward,
                self.world,
            )
        finally:
            self.release_gpu_memory()
