"""Pure PPO math for LLM post-training: small functions of torch tensors.

Shapes: ``b`` sequences, ``t`` response tokens, ``V`` vocabulary. Every ``(b, t)``
mask marks real response tokens with a non-zero entry; padding may be anywhere and the
values stored under it are never read. See ``docs/algorithms.md`` for the ledger of
implementation details and the metric glossary.
"""

from __future__ import annotations

from meshrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    discounted_return_to_go,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from meshrl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from meshrl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from meshrl.algorithms.groups import GroupStats, group_stats
from meshrl.algorithms.kl import (
    KL_CONTROLLER_TYPES,
    KL_ESTIMATOR_KINDS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)
from meshrl.algorithms.masked import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    safe_div,
    valid_positions,
    zero_masked,
)
from meshrl.algorithms.metrics import explained_variance, masked_stats
from meshrl.algorithms.overlong import overlong_penalty
from meshrl.algorithms.policy_loss import (
    PolicyLoss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)
from meshrl.algorithms.rewards import (
    TokenRewards,
    last_token_index,
    place_on_last_token,
    token_level_rewards,
)
from meshrl.algorithms.value_loss import ValueLoss, clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageResult",
    "FixedKLController",
    "GroupStats",
    "PolicyLoss",
    "TokenRewards",
    "ValueLoss",
    "aggregate_loss",
    "clipped_value_loss",
    "discounted_return_to_go",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "kl_penalty",
    "last_token_index",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_stats",
    "overlong_penalty",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_on_last_token",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "geo_mean_policy_loss",
    "clip_cov_policy_loss",
    "kl_cov_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_mismatch_metrics",
    "safe_div",
    "token_level_rewards",
    "truncated_is_weights",
    "valid_positions",
    "zero_masked",
]
