"""The actor: the policy being trained. Scores responses (old log-probs), runs PPO
updates, and streams its full weights to the rollout servers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypedDict

import torch
from torch.profiler import record_function

from meshrl.algorithms.aggregation import aggregate_loss
from meshrl.algorithms.kl import kl_penalty
from meshrl.algorithms.loss_modes import PolicyLossInputs, PolicyLossSettings
from meshrl.algorithms.policy_loss import rollout_mismatch_metrics, truncated_is_weights
from meshrl.algorithms.registry import policy_loss
from meshrl.config.schema import RunConfig
from meshrl.ragged import Ragged
from services.trainer.backends import TrainerBackend, trainer_backend
from services.trainer.distributed import World
from services.trainer.forward import response_logprobs, rollout_temperature
from services.trainer.fsdp.sharding import keeps_gathered
from services.trainer.lora import adapters_off
from services.trainer.micro_batches import MicroBatch, MiniBatch
from services.trainer.padding_free import pack_micro_batch
from services.trainer.scoring import ForwardSettings, log_prob_settings, policy_log_probs
from services.trainer.sequences import ragged_to_padded, to_device
from services.trainer.trained_role import Optimization, TrainedRole
from services.trainer.types import SequenceBatch


class _Counts(TypedDict):
    """The loss functions' keyword arguments for the whole mini-batch's counts."""

    global_token_count: int
    global_seq_count: int


@dataclass(frozen=True)
class PolicyTargets:
    """Per-token inputs of one update, ``(b, w)`` padded to the loss width."""

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None
    is_weights: torch.Tensor | None  # truncated importance weights, when enabled
    loss_mask: torch.Tensor | None = None  # bool, the model's tokens; None: every real one
    behaviour_logprobs: torch.Tensor | None = None  # the rollout's, for a loss that needs them


class ActorRole(TrainedRole):
    name = "actor"

    def __init__(
        self,
        model: torch.nn.Module,
        optimization: Optimization,
        loss: PolicyLossSettings,
        temperature: float,
        log_prob: ForwardSettings,
        world: World,
        offload: tuple[bool, bool] = (False, False),
        backend: TrainerBackend | None = None,
    ):
        super().__init__(model, optimization, world, offload, backend)
        self.loss = loss
        self.loss_entry = policy_loss(loss.loss_mode)  # what the loss needs (registry.py)
        self.loss_fn = self.loss_entry.load()
        self.temperature = temperature
        self.log_prob = log_prob
        # The update's micro-batches take the log-prob passes' layout: the model's
        # attention implementation is chosen for one of them (model_loading.py).
        self.padding_free = log_prob.padding_free

    @staticmethod
    def build(cfg: RunConfig, world: World) -> ActorRole:
        arr = cfg.actor_rollout_ref
        backend = trainer_backend(arr.actor.strategy)
        model = backend.policy_model(cfg, world, trained=True)
        return ActorRole(
            model=model,
            optimization=Optimization.from_config(
                model,
                arr.actor,
                cfg,
                arr.actor.use_dynamic_bsz,
                # The actor first updates after the critic-only steps (coordinator's
                # ppo_step.updates): its warm-up starts there, as verl's scheduler does.
                first_step=cfg.critic.critic_warmup + 1,
            ),
            loss=PolicyLossSettings.from_config(cfg),
            temperature=rollout_temperature(cfg),
            log_prob=log_prob_settings(cfg, arr.rollout),
            world=backend.data_world(model, world),
            offload=(arr.actor.param_offload, arr.actor.optimizer_offload),
            backend=backend,
        )

    def compute_log_probs(
        self,
        batch: SequenceBatch,
        temperature: float | None = None,
        with_entropy: bool = False,
        base_model: bool = False,
    ) -> tuple[Ragged, Ragged | None]:
        """Log-probs (and entropies) of every response token, aligned with responses.ids.

        ``temperature`` None uses the rollout's, the one ``update_policy`` uses. On one
        rank the gathered weights stay for the update that follows (``fsdp.resharded``).
        ``base_model``: a LoRA actor's base weights alone, the reference policy
        (``lora.adapters_off``; ValueError without adapters).
        """
        with adapters_off(self.model) if base_model else nullcontext():
            return policy_log_probs(
                self.model,
                batch,
                temperature or self.temperature,
                with_entropy,
                self.log_prob,
                self.world,
                keep_gathered=keeps_gathered(self.world.world_size),
            )

    def update_policy(
        self,
        batch: SequenceBatch,
        old_logprobs: Ragged,
        advantages: Ragged,
        ref_logprobs: Ragged | None,
        rollout_logprobs: Ragged | None,
        global_step: int,
    ) -> dict[str, float]:
        """PPO epochs over the batch; returns verl-named ``actor/*`` metrics.

        ``actor/kl_loss`` and ``actor/kl_coef`` are present when ``use_kl_loss``;
        ``training/rollout_probs_diff_*`` when ``rollout_logprobs`` is given.
        """
        if self.loss.use_kl_loss and ref_logprobs is None:
            raise ValueError("use_kl_loss is set but the request has no ref_logprobs")
        if self.loss_entry.needs_behaviour_logprobs and rollout_logprobs is None:
            raise ValueError(
                f"policy_loss.loss_mode={self.loss_entry.name} needs the rollout's log-probs, "
                "but the request has no rollout_logprobs"
            )
        targets, extra = self._targets(
            batch, old_logprobs, advantages, ref_logprobs, rollout_logprobs
        )
        metrics = self._run_update(
            batch,
            global_step,
            lambda micro, mini: self._micro_loss(batch, targets, micro, mini),
        )
        if self.loss.use_kl_loss:
            extra["actor/kl_coef"] = self.loss.kl_loss_coef
        return {**metrics, **extra}

    def _targets(
        self,
        batch: SequenceBatch,
        old_logprobs: Ragged,
        advantages: Ragged,
        ref_logprobs: Ragged | None,
        rollout_logprobs: Ragged | None,
    ) -> tuple[PolicyTargets, dict[str, float]]:
        named = {
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "ref_logprobs": ref_logprobs,
            "rollout_logprobs": rollout_logprobs,
        }
        for name, values in named.items():
            if values is not None and values.values.numel() != batch.num_response_tokens:
                raise ValueError(
                    f"{name} has {values.values.numel()} values for "
                    f"{batch.num_response_tokens} response tokens"
                )
        width = max(self.loss.loss_width, int(batch.response_lengths.max()))

        def padded(values: Ragged) -> torch.Tensor:
            return ragged_to_padded(values, width).float()

        old = padded(old_logprobs)
        mask = batch.padded_loss_mask(width)  # (b, width) the model's own tokens
        extra: dict[str, float] = {}
        is_weights, behaviour = None, None
        if rollout_logprobs is not None:
            rollout = padded(rollout_logprobs)
            extra = rollout_mismatch_metrics(old, rollout, mask)
            if self.loss.tis_imp_ratio_cap > 0:
                is_weights = truncated_is_weights(old, rollout, mask, self.loss.tis_imp_ratio_cap)
            if self.loss_entry.needs_behaviour_logprobs:
                behaviour = rollout
        ref = None if ref_logprobs is None else padded(ref_logprobs)
        loss_mask = mask if batch.loss_mask is not None else None
        targets = PolicyTargets(old, padded(advantages), ref, is_weights, loss_mask, behaviour)
        return targets, extra

    def _micro_loss(
        self, batch: SequenceBatch, targets: PolicyTargets, micro: MicroBatch, mini: MiniBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.loss
        width = targets.old_logprobs.shape[1]
        with record_function("meshrl/pack"):
            packed = pack_micro_batch(batch.select(micro.rows), self.padding_free)
            packed = packed.to(self.world.device)

            def rows(x: torch.Tensor) -> torch.Tensor:
                return to_device(x[micro.rows], self.world.device)

            def optional_rows(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else rows(x)

            # Copied before the forward is queued, through pinned memory (to_device): the
            # host queues this micro-batch while the GPU still runs the previous one.
            old_logprobs, advantages = rows(targets.old_logprobs), rows(targets.advantages)
            is_weights = optional_rows(targets.is_weights)
            ref_logprobs = optional_rows(targets.ref_logprobs)
            loss_mask = optional_rows(targets.loss_mask)
            behaviour_logprobs = optional_rows(targets.behaviour_logprobs)
        with record_function("meshrl/forward"):
            scores = response_logprobs(
                self.model,
                packed,
                self.temperature,
                with_entropy=True,
                entropy_grad=cfg.entropy_coeff != 0,
            )
        assert scores.entropy is not None  # with_entropy=True
        logprobs = widen(scores.logprobs, width)  # (m, width)
        entropy = widen(scores.entropy, width)
        mask = widen(packed.response_mask, width)
        if loss_mask is not None:  # a multi-turn rollout's observations are not the model's
            mask = mask & loss_mask

        counts: _Counts = {
            "global_token_count": mini.token_count,
            "global_seq_count": mini.seq_count,
        }
        generator = None
        if self.loss_entry.draws:
            generator = torch.Generator(self.world.device)
            generator.manual_seed(cfg.draw_seed(self.update_count, micro.rows))
        # the loss named by policy_loss.loss_mode (meshrl/algorithms/registry.py)
        pg = self.loss_fn(
            PolicyLossInputs(
                logprobs, old_logprobs, advantages, mask, is_weights,
                mini.token_count, mini.seq_count, generator, behaviour_logprobs,
            ),
            cfg,
        )  # fmt: skip
        entropy_agg = aggregate_loss(entropy, mask, cfg.loss_agg_mode, **counts)
        loss = pg.loss - cfg.entropy_coeff * entropy_agg
        # This micro-batch's share of the mini-batch's tokens turns its token means into
        # contributions that sum (over micro-batches and ranks) to the mini-batch's mean.
        share = mask.sum() / max(mini.token_count, 1)
        metrics = {
            "actor/pg_loss": pg.loss,
            "actor/entropy": entropy_agg,
            "actor/pg_clipfrac": pg.clipfrac * share,
            "actor/pg_clipfrac_lower": pg.clipfrac_lower * share,
            "actor/ppo_kl": pg.approx_kl * share,
        }
        if cfg.use_kl_loss:
            assert ref_logprobs is not None  # update_policy refuses use_kl_loss without them
            kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_loss_type)
            kl_agg = aggregate_loss(kl, mask, cfg.loss_agg_mode, **counts)
            loss = loss + cfg.kl_loss_coef * kl_agg
            metrics["actor/kl_loss"] = kl_agg
        return loss, metrics

    def named_param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Hugging Face names and full (un-sharded) shapes, in ``iter_full_params`` order
        (LoRA adapters are merged into their layers' weights: lora.py)."""
        return self.backend.full_shapes(self.model)

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor), one parameter at a time, so the whole model is never
        gathered at once. Each gather is a collective: every rank must drain this
        iterator in step. The backend maps its own names to Hugging Face's."""
        yield from self.backend.full_params(self.model)


def widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """(m, r) -> (m, width), zero (False) in the new columns; any dtype."""
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], dim=1)
