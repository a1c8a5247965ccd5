"""What the trained roles (actor, critic) share: a sharded model, the optimizer, learning-rate
schedule and PPO update settings that train it, one timed update loop, and checkpoints.

Each role adds only its own loss (and its own forward passes); the reference model, which is
never trained, has none of this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshrl.config.schema import RunConfig
from meshrl.config.sections import ActorConfig, CriticConfig
from services.trainer.backends import TrainerBackend, trainer_backend
from services.trainer.distributed import World
from services.trainer.lora import lora_settings
from services.trainer.mfu import (
    UpdateTimer,
    peak_memory_metrics,
    perf_metrics,
    weighted_matmul_params,
)
from services.trainer.offload import StateOffload
from services.trainer.optim import LrSchedule, build_optimizer
from services.trainer.types import SequenceBatch
from services.trainer.update_loop import MicroLoss, UpdateSettings, run_update


@dataclass(frozen=True)
class Optimization:
    """How a role's model is trained: optimizer, LR schedule, epochs and batch layout."""

    optimizer: torch.optim.Optimizer
    schedule: LrSchedule
    update: UpdateSettings

    @staticmethod
    def from_config(
        model: torch.nn.Module,
        role: ActorConfig | CriticConfig,
        cfg: RunConfig,
        dynamic_bsz: bool,
        first_step: int = 1,
    ) -> Optimization:
        """``role`` is ``actor_rollout_ref.actor`` or ``critic`` (the same field names);
        ``dynamic_bsz`` is the role's resolved ``use_dynamic_bsz``; ``first_step`` the PPO
        step of the role's first update, where its lr schedule starts."""
        assert role.ppo_mini_batch_size is not None  # the critic's is filled by RunConfig
        update = UpdateSettings(
            mini_batch_rows=role.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n,
            micro_batch_rows=role.ppo_micro_batch_size_per_gpu,
            epochs=role.ppo_epochs,
            shuffle=role.shuffle,
            grad_clip=role.grad_clip,
            seed=cfg.trainer.seed,
            max_tokens=role.ppo_max_token_len_per_gpu if dynamic_bsz else None,
        )
        return Optimization(
            optimizer=build_optimizer(model.parameters(), role.optim),
            schedule=LrSchedule.from_config(
                role.optim, cfg.trainer.total_training_steps, first_step
            ),
            update=update,
        )


class TrainedRole:
    """Base of the actor and critic roles; a subclass sets ``name`` and supplies the loss."""

    name: str  # the metrics' prefix ("actor/...") and the checkpoint's role

    def __init__(
        self,
        model: torch.nn.Module,
        optimization: Optimization,
        world: World,
        offload: tuple[bool, bool] = (False, False),
        backend: TrainerBackend | None = None,
    ):
        """``offload``: (param_offload, optimizer_offload) of the role's config; ``backend``
        the one that built ``model`` (None: FSDP2's)."""
        self.backend = backend or trainer_backend("fsdp2")
        self.model = model
        self.optimizer = optimization.optimizer
        self.schedule = optimization.schedule
        self.update = optimization.update
        self.world = world
        # Updates applied so far (checkpointed). Not a weight version: that names weights by
        # the step that made them, which the coordinator gives (docs/weight_sync.md).
        self.update_count = 0
        self.memory = StateOffload(model, self.optimizer, world.device, *offload)

    @property
    def num_parameters(self) -> int:
        """The model's parameters, as ServerInfo reports them: a LoRA run's adapters are not
        counted (outside the trainer they are merged into the weights they adapt)."""
        return full_parameter_count(self.backend, self.model)

    def _run_update(
        self, batch: SequenceBatch, global_step: int, micro_loss: MicroLoss
    ) -> dict[str, float]:
        """PPO epochs of ``micro_loss`` over ``batch``, timed; returns the loop's metrics
        with the throughput ones (``perf/*``) and counts one more weight version."""
        self.model.train()
        with UpdateTimer(self.world.device) as timer:
            metrics = run_update(
                batch.loss_lengths,  # the losses' token counts: the model's tokens alone
                self.update,
                global_step,
                micro_loss,
                self.model,
                self.optimizer,
                self.schedule,
                self.world,
                self.name,
                sequence_lengths=batch.prompts.lengths + batch.response_lengths,
            )
        metrics.update(
            perf_metrics(
                self.name,
                self.model,
                (batch.prompts.lengths + batch.responses.lengths).tolist(),
                self.update.epochs,
                timer.seconds,
                # Per device: each model-parallel rank holds 1/model_parallel of the matmul
                # weights (its replicated norms, a sliver, are counted model_parallel times).
                self.world.devices,
                n_params=weighted_matmul_params(self.model) * self.world.model_parallel,
            )
        )
        metrics.update(peak_memory_metrics(self.name, self.world.device))
        self.update_count += 1
        return metrics

    def save(self, path: str, with_optimizer: bool) -> None:
        meta = {
            "role": self.name,
            "update_count": self.update_count,
            "backend": self.backend.NAME,
        }
        if (lora := lora_settings(self.model)) is not None:
            meta["lora"] = lora  # what an export needs to merge the adapters
        optimizer = self.optimizer if with_optimizer else None
        self.backend.save_checkpoint(path, self.model, optimizer, meta)

    def load(self, path: str, with_optimizer: bool) -> None:
        expected = lora_settings(self.model)

        def check(meta: dict) -> None:
            # Checked before any tensor is read: DCP would only name a missing key.
            _check_backend(path, meta.get("backend", "fsdp"), self.backend.NAME)
            _check_lora(path, meta.get("lora"), expected)

        meta = self.backend.load_checkpoint(
            path, self.model, self.optimizer if with_optimizer else None, check=check
        )
        # "weight_version": the name a checkpoint written before the rename gave it
        self.update_count = int(meta.get("update_count", meta.get("weight_version", 0)))


def full_parameter_count(backend: TrainerBackend, model: torch.nn.Module) -> int:
    """The elements of the model's full Hugging Face tensors (those weight sync sends),
    whatever the ranks hold of them."""
    return sum(math.prod(shape) for _, shape in backend.full_shapes(model))


def _check_backend(path: str, saved: str, here: str) -> None:
    if saved != here:
        raise ValueError(
            f"{path} was saved by the {saved} trainer backend, and this role runs {here} "
            "(its strategy): resume with the strategy it was trained with, or start this "
            "run from the exported Hugging Face folder (meshrl export)"
        )


def _check_lora(path: str, saved: dict | None, expected: dict | None) -> None:
    def describe(lora: dict | None) -> str:
        if lora is None:
            return "no LoRA adapters (lora_rank 0)"
        return f"LoRA adapters of rank {lora['rank']}, lora_alpha {lora['alpha']}"

    if saved == expected:
        return
    if saved is not None and expected is not None and describe(saved) == describe(expected):
        # Same rank and scale, other layers (target_modules / exclude_modules changed).
        only_saved = sorted(set(saved.get("layers", [])) - set(expected["layers"]))
        only_here = sorted(set(expected["layers"]) - set(saved.get("layers", [])))
        raise ValueError(
            f"{path} holds LoRA adapters on other layers than this run's model "
            f"(target_modules / exclude_modules): only in the checkpoint {only_saved[:3]}, "
            f"only here {only_here[:3]}; resume with the settings it was trained with"
        )
    raise ValueError(
        f"{path} holds {describe(saved)}, but this run's model has {describe(expected)}: "
        "resume with the model settings the checkpoint was trained with"
    )
