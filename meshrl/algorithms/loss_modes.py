"""The policy losses in the one form the registry names
(:data:`meshrl.algorithms.registry.POLICY_LOSSES`): ``(PolicyLossInputs,
PolicyLossSettings) -> PolicyLoss``. Each is one call of its pure function in
:mod:`meshrl.algorithms.policy_loss`, with the actor's settings as its arguments.

The caller (the actor's micro-batch loss) gives a loss what its entry declares it needs:
``generator`` where it ``draws``, ``behaviour_logprobs`` where it
``needs_behaviour_logprobs``; a loss may assert them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from meshrl.algorithms.policy_loss import (
    PolicyLoss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
)
from meshrl.config.schema import RunConfig

__all__ = [
    "PolicyLossInputs",
    "PolicyLossSettings",
    "clip_cov",
    "geo_mean",
    "gspo",
    "kl_cov",
    "vanilla",
]


@dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's loss, from ``actor_rollout_ref.actor``."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    tis_imp_ratio_cap: float
    loss_mode: str  # a name of meshrl.algorithms.registry.POLICY_LOSSES
    loss_width: int  # response columns of the loss: Dr. GRPO's constant T (max_response_length)
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float
    seed: int  # trainer.seed, of the draws of a loss that draws (clip_cov)

    @staticmethod
    def from_config(cfg: RunConfig) -> PolicyLossSettings:
        a = cfg.actor_rollout_ref.actor
        return PolicyLossSettings(
            clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type,
            tis_imp_ratio_cap=a.tis_imp_ratio_cap,
            loss_mode=a.policy_loss.loss_mode,
            loss_width=cfg.data.max_response_length,
            clip_cov_ratio=a.policy_loss.clip_cov_ratio,
            clip_cov_lb=a.policy_loss.clip_cov_lb,
            clip_cov_ub=a.policy_loss.clip_cov_ub,
            kl_cov_ratio=a.policy_loss.kl_cov_ratio,
            ppo_kl_coef=a.policy_loss.ppo_kl_coef,
            seed=cfg.trainer.seed,
        )

    def draw_seed(self, update: int, rows: Tensor) -> int:
        """Seed of a loss's draw in one micro-batch (clip_cov's), from the run (``seed``), the
        update (the actor's update_count: checkpoints keep it) and the micro-batch's rows.
        verl draws from torch's global generator; this draw is reproducible, a resumed run
        draws as the uninterrupted one would have, and micro-batches, steps and ranks differ."""
        key = repr([self.seed, update, *rows.tolist()]).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class PolicyLossInputs(NamedTuple):
    """One micro-batch's inputs of a policy loss; ``(m, t)`` over its response columns."""

    logprobs: Tensor
    """``(m, t)`` the current policy's log-probs, with grad."""
    old_logprobs: Tensor
    """``(m, t)`` the log-probs of the policy that generated the batch (``old_log_prob``)."""
    advantages: Tensor
    """``(m, t)``."""
    mask: Tensor
    """``(m, t)`` bool, the tokens the loss covers (the model's own response tokens)."""
    is_weights: Tensor | None
    """``(m, t)`` truncated importance weights π_old / π_rollout when enabled; detached."""
    global_token_count: int
    """The mini-batch's tokens, for micro-batch accumulation."""
    global_seq_count: int
    """The mini-batch's responses, for micro-batch accumulation."""
    generator: torch.Generator | None = None
    """Seeded, on the device, for a loss whose entry ``draws``."""
    behaviour_logprobs: Tensor | None = None
    """``(m, t)`` the rollout engine's log-probs, for a loss that ``needs_behaviour_logprobs``."""


def vanilla(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """:func:`~meshrl.algorithms.policy_loss.ppo_policy_loss`: clip, dual clip, loss_agg_mode."""
    return ppo_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c, loss_agg_mode=s.loss_agg_mode, is_weights=x.is_weights,
        global_token_count=x.global_token_count, global_seq_count=x.global_seq_count,
    )  # fmt: skip


def gspo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """:func:`~meshrl.algorithms.policy_loss.gspo_policy_loss` (its own aggregation)."""
    return gspo_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        global_seq_count=x.global_seq_count, is_weights=x.is_weights,
    )  # fmt: skip


def geo_mean(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """:func:`~meshrl.algorithms.policy_loss.geo_mean_policy_loss` (its own aggregation)."""
    return geo_mean_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        global_seq_count=x.global_seq_count, is_weights=x.is_weights,
    )  # fmt: skip


def clip_cov(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """:func:`~meshrl.algorithms.policy_loss.clip_cov_policy_loss`, drawing from
    ``x.generator``."""
    return clip_cov_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        loss_agg_mode=s.loss_agg_mode, is_weights=x.is_weights,
        global_token_count=x.global_token_count, global_seq_count=x.global_seq_count,
        clip_cov_ratio=s.clip_cov_ratio, clip_cov_lb=s.clip_cov_lb, clip_cov_ub=s.clip_cov_ub,
        generator=x.generator,
    )  # fmt: skip


def kl_cov(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLoss:
    """:func:`~meshrl.algorithms.policy_loss.kl_cov_policy_loss`."""
    return kl_cov_policy_loss(
        x.logprobs, x.old_logprobs, x.advantages, x.mask,
        loss_agg_mode=s.loss_agg_mode, is_weights=x.is_weights,
        global_token_count=x.global_token_count, global_seq_count=x.global_seq_count,
        kl_cov_ratio=s.kl_cov_ratio, ppo_kl_coef=s.ppo_kl_coef,
    )  # fmt: skip
