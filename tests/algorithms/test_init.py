"""The package re-exports its public API."""

from __future__ import annotations

import meshrl.algorithms as algorithms


def test_all_names_are_exported():
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name
    for name in (
        "masked_sum masked_mean masked_var masked_whiten LOSS_AGG_MODES aggregate_loss "
        "KL_ESTIMATORS kl_penalty FixedKLController AdaptiveKLController make_kl_controller "
        "TokenRewards token_level_rewards AdvantageResult gae_advantages grpo_advantages "
        "rloo_advantages reinforce_plus_plus_advantages reinforce_plus_plus_baseline_advantages "
        "remax_advantages ADVANTAGE_ESTIMATORS PolicyLoss ppo_policy_loss gspo_policy_loss geo_mean_policy_loss clip_cov_policy_loss kl_cov_policy_loss truncated_is_weights "
        "rollout_mismatch_metrics ValueLoss clipped_value_loss entropy_from_logits "
        "logprobs_from_logits explained_variance masked_stats"
    ).split():
        assert name in algorithms.__all__, name


def test_constants():
    assert algorithms.KL_ESTIMATORS == ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
    assert algorithms.LOSS_AGG_MODES == (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
