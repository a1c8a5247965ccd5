"""Pure PPO math for LLM post-training: small functions of torch tensors.

Shapes: ``b`` sequences, ``t`` response tokens, ``V`` vocabulary. Every ``(b, t)``
mask marks real response tokens with a non-zero entry; padding may be anywhere and the
values stored under it are never read. See ``docs/algorithms.md`` for the ledger of
implementation details and the metric glossary.

The package re-exports its public API lazily (each name's module is imported on first
access), so that its torch-free modules load without torch: the run config reads
:mod:`meshrl.algorithms.registry` for the names of the estimators and policy losses.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "advantages": (
        "ADVANTAGE_ESTIMATORS",
        "AdvantageResult",
        "discounted_return_to_go",
        "gae_advantages",
        "grpo_advantages",
        "reinforce_plus_plus_advantages",
        "reinforce_plus_plus_baseline_advantages",
        "remax_advantages",
        "rloo_advantages",
    ),
    "aggregation": (
        "LOSS_AGG_MODES",
        "aggregate_loss",
    ),
    "entropy": (
        "entropy_from_logits",
        "logprobs_from_logits",
    ),
    "groups": (
        "GroupStats",
        "group_stats",
    ),
    "kl": (
        "KL_CONTROLLER_TYPES",
        "KL_ESTIMATOR_KINDS",
        "KL_ESTIMATORS",
        "AdaptiveKLController",
        "FixedKLController",
        "kl_penalty",
        "make_kl_controller",
    ),
    "masked": (
        "masked_mean",
        "masked_sum",
        "masked_var",
        "masked_whiten",
        "safe_div",
        "valid_positions",
        "zero_masked",
    ),
    "metrics": (
        "explained_variance",
        "masked_stats",
    ),
    "overlong": ("overlong_penalty",),
    "policy_loss": (
        "PolicyLoss",
        "clip_cov_policy_loss",
        "geo_mean_policy_loss",
        "gspo_policy_loss",
        "kl_cov_policy_loss",
        "ppo_policy_loss",
        "rollout_mismatch_metrics",
        "truncated_is_weights",
    ),
    "rewards": (
        "TokenRewards",
        "last_token_index",
        "place_on_last_token",
        "token_level_rewards",
    ),
    "value_loss": (
        "ValueLoss",
        "clipped_value_loss",
    ),
}
"""module of this package -> the names it exports here."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
