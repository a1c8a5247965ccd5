"""The critic: values of response tokens, trained by PPO's clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algorithms.masked import masked_mean
from meshrl.algorithms.value_loss import clipped_value_loss
from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.trainer.checkpoint import load_checkpoint, save_checkpoint
from services.trainer.distributed import World
from services.trainer.forward import response_values
from services.trainer.fsdp import mixed_precision, shard_model
from services.trainer.mfu import UpdateTimer, perf_metrics
from services.trainer.micro_batches import MicroBatch, MiniBatch
from services.trainer.model_loading import load_value_model
from services.trainer.optim import LrSchedule, build_optimizer
from services.trainer.padding_free import pack_micro_batch
from services.trainer.scoring import ForwardSettings, score_batch
from services.trainer.sequences import SequenceBatch, ragged_to_padded
from services.trainer.update_loop import UpdateSettings, run_update


@dataclass(frozen=True)
class ValueLossSettings:
    cliprange_value: float
    loss_agg_mode: str

    @staticmethod
    def from_config(cfg: RunConfig) -> ValueLossSettings:
        return ValueLossSettings(cfg.critic.cliprange_value, cfg.critic.loss_agg_mode)


class CriticRole:
    name = "critic"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: LrSchedule,
        loss: ValueLossSettings,
        update: UpdateSettings,
        forward: ForwardSettings,
        world: World,
    ):
        self.model = model
        self.optimizer = optimizer
        self.schedule = schedule
        self.loss = loss
        self.update = update
        self.forward = forward  # value passes; their layout is the update's too
        self.world = world
        self.weight_version = 0

    @staticmethod
    def build(cfg: RunConfig, world: World) -> CriticRole:
        c = cfg.critic
        path = c.model.path or cfg.actor_rollout_ref.model.path
        model = load_value_model(
            path, world.device, c.model.enable_gradient_checkpointing, c.model.use_remove_padding
        )
        model = shard_model(model, world.mesh, mixed_precision(c.model.dtype))
        dynamic = c.use_dynamic_bsz
        if dynamic is None:  # verl's default: the actor's setting
            dynamic = cfg.actor_rollout_ref.actor.use_dynamic_bsz
        forward_budget = c.forward_max_token_len_per_gpu or c.ppo_max_token_len_per_gpu
        update = UpdateSettings(
            mini_batch_rows=c.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n,
            micro_batch_rows=c.ppo_micro_batch_size_per_gpu,
            epochs=c.ppo_epochs,
            shuffle=c.shuffle,
            grad_clip=c.grad_clip,
            seed=cfg.trainer.seed,
            max_tokens=c.ppo_max_token_len_per_gpu if dynamic else None,
        )
        forward = ForwardSettings(
            micro_batch_rows=c.ppo_micro_batch_size_per_gpu,
            max_tokens=forward_budget if dynamic else None,
            padding_free=c.model.use_remove_padding,
        )
        return CriticRole(
            model=model,
            optimizer=build_optimizer(model.parameters(), c.optim),
            schedule=LrSchedule.from_config(c.optim, cfg.trainer.total_training_steps),
            loss=ValueLossSettings.from_config(cfg),
            update=update,
            forward=forward,
            world=world,
        )

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def compute_values(self, batch: SequenceBatch) -> Ragged:
        """The value of every response token, aligned with responses.ids."""
        self.model.eval()
        try:
            (values,) = score_batch(
                batch,
                self.forward,
                lambda packed: (response_values(self.model, packed),),
                self.world,
            )
        finally:
            self.model.train()
        return values

    def update_value(
        self, batch: SequenceBatch, old_values: Ragged, returns: Ragged, global_step: int
    ) -> dict[str, float]:
        """PPO epochs of clipped value regression; returns verl-named ``critic/*`` metrics."""
        n = batch.num_response_tokens
        for name, values in (("old_values", old_values), ("returns", returns)):
            if values.values.numel() != n:
                raise ValueError(
                    f"{name} has {values.values.numel()} values for {n} response tokens"
                )
        width = int(batch.response_lengths.max())
        old = ragged_to_padded(old_values, width).float()  # (b, r)
        target = ragged_to_padded(returns, width).float()
        self.model.train()

        def micro_loss(micro: MicroBatch, mini: MiniBatch):
            rows = batch.select(micro.rows)
            packed = pack_micro_batch(rows, self.forward.padding_free, width)
            packed = packed.to(self.world.device)
            mask = packed.response_mask
            values = response_values(self.model, packed)  # (m, r)
            vl = clipped_value_loss(
                values,
                old[micro.rows].to(self.world.device),
                target[micro.rows].to(self.world.device),
                mask,
                cliprange_value=self.loss.cliprange_value,
                loss_agg_mode=self.loss.loss_agg_mode,
                global_token_count=mini.token_count,
                global_seq_count=mini.seq_count,
            )
            share = mask.sum() / max(mini.token_count, 1)
            return vl.loss, {
                "critic/vf_loss": vl.loss,
                "critic/vf_clipfrac": vl.clipfrac * share,
                "critic/vpred_mean": masked_mean(values.detach(), mask) * share,
            }

        with UpdateTimer(self.world.device) as timer:
            metrics = run_update(
                batch.response_lengths,
                self.update,
                global_step,
                micro_loss,
                self.model,
                self.optimizer,
                self.schedule,
                self.world,
                "critic",
                sequence_lengths=batch.prompts.lengths + batch.response_lengths,
            )
        lengths = (batch.prompts.lengths + batch.responses.lengths).tolist()
        metrics.update(
            perf_metrics(
                "critic",
                self.model,
                lengths,
                self.update.epochs,
                timer.seconds,
                self.world.world_size,
            )
        )
        self.weight_version += 1
        return metrics

    def save(self, path: str, with_optimizer: bool) -> None:
        meta = {"role": self.name, "weight_version": self.weight_version}
        save_checkpoint(path, self.model, self.optimizer if with_optimizer else None, meta)

    def load(self, path: str, with_optimizer: bool) -> None:
        meta = load_checkpoint(path, self.model, self.optimizer if with_optimizer else None)
        self.weight_version = int(meta.get("weight_version", 0))
