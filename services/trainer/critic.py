"""The critic: values of response tokens, trained by PPO's clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.algorithms.masked import masked_mean
from meshrl.algorithms.value_loss import clipped_value_loss
from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.trainer.backends import TrainerBackend, trainer_backend
from services.trainer.distributed import World
from services.trainer.forward import response_values
from services.trainer.fsdp.sharding import keeps_gathered, resharded
from services.trainer.micro_batches import MicroBatch, MiniBatch
from services.trainer.padding_free import pack_micro_batch
from services.trainer.scoring import ForwardSettings, score_batch
from services.trainer.sequences import ragged_to_padded, to_device
from services.trainer.trained_role import Optimization, TrainedRole
from services.trainer.types import SequenceBatch


@dataclass(frozen=True)
class ValueLossSettings:
    cliprange_value: float
    loss_agg_mode: str
    loss_width: int  # Dr. GRPO's constant T (max_response_length), as the actor's

    @staticmethod
    def from_config(cfg: RunConfig) -> ValueLossSettings:
        c = cfg.critic
        return ValueLossSettings(c.cliprange_value, c.loss_agg_mode, cfg.data.max_response_length)


def compute_dtype(cfg: RunConfig) -> str | None:
    """``critic.model.dtype``, or the actor's when unset (a bf16 actor beside a float32
    critic is rarely meant: it doubled the first H200 step's time)."""
    return cfg.critic.model.dtype or cfg.actor_rollout_ref.model.dtype


class CriticRole(TrainedRole):
    name = "critic"

    def __init__(
        self,
        model: torch.nn.Module,
        optimization: Optimization,
        loss: ValueLossSettings,
        forward: ForwardSettings,
        world: World,
        offload: tuple[bool, bool] = (False, False),
        backend: TrainerBackend | None = None,
    ):
        super().__init__(model, optimization, world, offload, backend)
        self.loss = loss
        self.forward = forward  # value passes; their layout is the update's too

    @staticmethod
    def build(cfg: RunConfig, world: World) -> CriticRole:
        c = cfg.critic
        backend = trainer_backend(c.strategy)
        model = backend.value_model(cfg, world)
        dynamic = c.use_dynamic_bsz
        if dynamic is None:  # verl's default: the actor's setting
            dynamic = cfg.actor_rollout_ref.actor.use_dynamic_bsz
        forward_budget = c.forward_max_token_len_per_gpu or c.ppo_max_token_len_per_gpu
        forward = ForwardSettings(
            micro_batch_rows=c.ppo_micro_batch_size_per_gpu,
            max_tokens=forward_budget if dynamic else None,
            padding_free=c.model.use_remove_padding,
        )
        return CriticRole(
            model=model,
            optimization=Optimization.from_config(model, c, cfg, dynamic),
            loss=ValueLossSettings.from_config(cfg),
            forward=forward,
            world=backend.data_world(model, world),
            offload=(c.param_offload, c.optimizer_offload),
            backend=backend,
        )

    def compute_values(self, batch: SequenceBatch) -> Ragged:
        """The value of every response token, aligned with responses.ids. On one rank the
        gathered weights stay for the update that follows (``fsdp.resharded``)."""
        self.model.eval()
        try:
            with resharded(self.model, keep=keeps_gathered(self.world.world_size)):
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
        # the model's tokens alone: a multi-turn rollout's observations have no value target
        loss_mask = batch.padded_loss_mask(width) if batch.loss_mask is not None else None

        def micro_loss(micro: MicroBatch, mini: MiniBatch):
            rows = batch.select(micro.rows)
            packed = pack_micro_batch(rows, self.forward.padding_free, width)
            packed = packed.to(self.world.device)
            # Before the forward is queued (see the actor's micro-batch loss).
            micro_old = to_device(old[micro.rows], self.world.device)
            micro_target = to_device(target[micro.rows], self.world.device)
            mask = packed.response_mask
            if loss_mask is not None:
                mask = mask & to_device(loss_mask[micro.rows], self.world.device)
            values = response_values(self.model, packed)  # (m, r)
            vl = clipped_value_loss(
                values,
                micro_old,
                micro_target,
                mask,
                cliprange_value=self.loss.cliprange_value,
                loss_agg_mode=self.loss.loss_agg_mode,
                global_token_count=mini.token_count,
                global_seq_count=mini.seq_count,
                # Not this batch's longest response: T must not change from step to step.
                norm_length=max(self.loss.loss_width, width),
            )
            share = mask.sum() / max(mini.token_count, 1)
            return vl.loss, {
                "critic/vf_loss": vl.loss,
                "critic/vf_clipfrac": vl.clipfrac * share,
                "critic/vpred_mean": masked_mean(values.detach(), mask) * share,
            }

        return self._run_update(batch, global_step, micro_loss)
