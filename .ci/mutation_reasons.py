"""Why each surviving mutant of the last run survived, by mutmut name (docs/testing.md);
the classes of .ci/mutation.py cover the rest. Kept by hand: a survivor whose reason is
not here is printed as needing one."""

# ruff: noqa: E501
MANUAL = {
    "meshrl.algorithms.advantages.x_rloo_advantages__mutmut_16": "equivalent: for a singleton group the scale n/(n-1) becomes 1/0 = inf, but `torch.where` takes the raw score for it",
    "meshrl.algorithms.advantages.x_rloo_advantages__mutmut_17": "equivalent: for a group of 2, n/(n-1) = 2 = n/1",
    "meshrl.algorithms.advantages.x_reinforce_plus_plus_baseline_advantages__mutmut_29": "equivalent: `masked_whiten`'s default eps is the 1e-8 passed",
    "meshrl.algorithms.groups.x_group_stats__mutmut_18": "equivalent: one more group, empty, whose statistics no row reads",
    "meshrl.algorithms.groups.x_group_stats__mutmut_19": "equivalent: an empty batch gets one empty group that no row reads",
    "meshrl.algorithms.groups.x_group_stats__mutmut_39": "dtype: an integer count divides a float sum: true division, the same float",
    "meshrl.algorithms.groups.x_group_stats__mutmut_47": "dtype: as above",
    "meshrl.algorithms.masked.x_masked_whiten__mutmut_14": "equivalent: `masked_var`'s default is `unbiased=True`",
    "meshrl.algorithms.kl.x__k3__mutmut_2": "equivalent: below log r = -20, k3 = e^x - x - 1 > 10 is clamped at 10 with or without the inner bound, and e^x -> 0 keeps the gradient finite",
    "meshrl.algorithms.kl.x__k3__mutmut_8": "equivalent: as above (-21 for -20)",
    "meshrl.algorithms.kl.x__k3__mutmut_10": "equivalent: k3 = e^x - x - 1 >= 0, the lower bound -10 never applies",
    "meshrl.algorithms.kl.x__k3__mutmut_18": "equivalent: as above (-11 for -10)",
    "services.coordinator.step.advantage.x_compute_advantages__mutmut_22": "equivalent: without KL in the reward no log-probs are passed, so the coefficient multiplies a zero KL",
    "services.coordinator.step.advantage.x_compute_advantages__mutmut_23": "equivalent: as above (1.0 times a zero KL)",
    "services.coordinator.step.advantage.x_compute_advantages__mutmut_26": "equivalent: without KL in the reward `rewards.kl` is zero, so the sequence reward is the score",
    "services.coordinator.step.advantage.x_compute_advantages__mutmut_112": "equivalent: without KL in the reward `rewards.kl_mean` is 0",
    "services.coordinator.step.ppo_step.xǁPPOStepǁadvantages__mutmut_6": "equivalent: a width of None pads to the longest response, which is the mask's width",
    "services.coordinator.step.ppo_step.xǁPPOStepǁadvantages__mutmut_12": "equivalent: a width of None pads to the longest response, the mask's width",
    "services.coordinator.step.ppo_step.xǁPPOStepǁadvantages__mutmut_40": "equivalent: a width of None pads to the longest response, the mask's width",
    "services.coordinator.step.ppo_step.xǁPPOStepǁadvantages__mutmut_46": "equivalent: a width of None pads to the longest response, the mask's width",
    "services.coordinator.step.ppo_step.xǁPPOStepǁadvantages__mutmut_50": "equivalent: a width of None pads to the longest response, the mask's width (the turn rewards are aligned with the responses)",
    "services.trainer.critic.xǁCriticRoleǁupdate_value__mutmut_12": "equivalent: a width of None pads to the longest response, which is `width`",
    "services.trainer.critic.xǁCriticRoleǁupdate_value__mutmut_17": "equivalent: as above",
    "services.trainer.critic.xǁCriticRoleǁupdate_value__mutmut_24": "equivalent in results: None packs padded rows instead of packed ones, and the two give the same values (`test_trainer_packing.py`); only speed differs",
    "meshrl.weight_sync.receiver.xǁWeightReceiverǁ_post__mutmut_23": "equivalent: `broadcast_async`'s default source is rank 0",
}
AUTO = {
    "axis": "equivalent (axis): `(b, t)` tensors, axis 1 is axis -1",
    "zip-strict": "equivalent (zip-strict): equal lengths by construction",
    "device": "equivalent here (device): CPU only",
    "dtype": "equivalent (dtype): the default or type promotion gives the same dtype",
    "label": "label: a profiler range's name",
    "message": "message: an error message's text",
}
for n in (33, 35, 37, 39):
    MANUAL[f"meshrl.algorithms.entropy.x__by_row_chunks__mutmut_{n}"] = (
        "equivalent: `split` of zero rows gives one empty chunk, so `pieces` is never empty and the `else` is dead code"
    )
MANUAL["meshrl.algorithms.kl.x__k3__mutmut_9"] = (
    "equivalent: e^21 is finite in float32, and k3 above log r = 20 is clamped at 10 (no gradient) either way"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_9"] = (
    "equivalent in results: None packs padded rows instead of packed ones, which give the same log-probs (`test_trainer_packing.py`); only speed differs"
)
MANUAL["services.trainer.critic.xǁCriticRoleǁupdate_value__mutmut_76"] = (
    "not equivalent (metric only): a mini-batch of a single token would report its mean prediction halved; no test has one"
)
MANUAL["meshrl.algorithms.policy_loss.x_clip_cov_policy_loss__mutmut_5"] = (
    "not killed: the default of an argument every caller passes (the actor passes the config's `clip_cov_ub`); `test_cov_losses_default_to_the_configs_defaults` reads the signature, which mutmut's trampoline keeps as it was"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_189"] = (
    "not equivalent (metric only): a mini-batch of a single token would report its clip fractions and approx KL halved; no test has one"
)
MANUAL["meshrl.algorithms.rewards.x_last_token_index__mutmut_24"] = (
    "equivalent (axis): `(b, t)` masks, axis 1 is axis -1"
)
MANUAL["meshrl.weight_sync.receiver.xǁWeightReceiverǁ__init____mutmut_11"] = (
    "equivalent: None is false like False, and the flag is only read for its truth"
)
MANUAL["meshrl.weight_sync.receiver.xǁWeightReceiverǁ__init____mutmut_8"] = (
    "equivalent: None is false like False, and `wrote_targets` is only read for its truth"
)
MANUAL["meshrl.weight_sync.receiver.xǁWeightReceiverǁwait_for_sender__mutmut_11"] = (
    "equivalent: `broadcast`'s default source is rank 0"
)
MANUAL["meshrl.algorithms.masked.x_masked_var__mutmut_30"] = (
    "equivalent: for n = 1 the Bessel factor becomes 1/0 = inf, but the result for n = 1 is taken from the other branch (0)"
)
MANUAL["meshrl.algorithms.masked.x_masked_var__mutmut_31"] = (
    "equivalent: for n = 2, n/(n-1) = 2 = n/1"
)
MANUAL["meshrl.algorithms.masked.x_masked_var__mutmut_41"] = (
    "equivalent: for n = 1 the variance is 0 and the factor 1, so both branches give 0"
)
MANUAL["meshrl.algorithms.policy_loss.x__largest__mutmut_19"] = (
    "not killed: only the order of equal covariances could change, and torch's CPU sort keeps ties in order either way; no test can tell on this machine"
)
MANUAL["meshrl.algorithms.policy_loss.x__largest__mutmut_21"] = "not killed: as above"
MANUAL["meshrl.weight_sync.receiver.xǁWeightReceiverǁwait_for_sender__mutmut_7"] = (
    "equivalent: the placeholder version is overwritten by the broadcast before it is read"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_115"] = (
    "not killed: Clip-Cov's draw would stop changing from one update to the next; `test_clip_cov_holds_tokens_back_and_a_seed_draws_the_same_ones` checks that a seed draws the same tokens again, not that the next update draws others"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_136"] = (
    "not killed: Clip-Cov's upper covariance bound falls back to the function's default 5.0, the config's default; no test sets another"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_113"] = (
    "equivalent here (device): CPU only"
)
MANUAL["meshrl.algorithms.masked.x__mask_count__mutmut_7"] = (
    "equivalent: `sum(dim=None)` sums every entry, as `sum()` does"
)
MANUAL["meshrl.algorithms.masked.x_masked_sum__mutmut_6"] = "equivalent: as above"
MANUAL["meshrl.algorithms.masked.x_safe_div__mutmut_7"] = (
    "equivalent: the denominator is 0 only for an empty mask, where the numerator is 0 too: 0/2 = 0/1"
)
MANUAL["meshrl.algorithms.masked.x_zero_masked__mutmut_6"] = (
    "not killed: float64 values would be weighted by float32 weights; exact for the 0/1 masks every caller passes, a fractional float64 weight would lose precision"
)
MANUAL["meshrl.algorithms.masked.x_zero_masked__mutmut_7"] = (
    "not killed: integer values would be weighted by integer weights; no caller masks integers"
)
MANUAL["meshrl.algorithms.policy_loss.x__token_log_ratios__mutmut_7"] = (
    "not killed: below a log-ratio of -20 the ratio is e^-20 = 2e-9 or smaller either way, below float32 resolution next to the other tokens' terms"
)
MANUAL["meshrl.algorithms.policy_loss.x__token_log_ratios__mutmut_17"] = (
    "not killed: as above (e^-21 for e^-20)"
)
MANUAL["meshrl.algorithms.policy_loss.x_ppo_policy_loss__mutmut_45"] = (
    "equivalent: with A = 0 the token's loss is 0 and the dual-clip cap c·|A| is 0, so `pg > cap` is false either way"
)
MANUAL["meshrl.algorithms.policy_loss.x_ppo_policy_loss__mutmut_47"] = (
    "not killed: at pg equal to the cap both branches give the same loss; only the dual-clip count could count the tie, and no test has one"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_targets__mutmut_44"] = (
    "not killed: a cap of exactly 0 (the config accepts it; -1 is its 'off') would call the IS weights, which refuse it, instead of switching IS off"
)
MANUAL["services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_200"] = (
    "not killed (metric only): `actor/pg_clipfrac_lower` divided instead of multiplied by the micro-batch's share; no test reads it with several micro-batches"
)
# the coordinator's step (PPOStep, the batch sources, the stages)
_STEP = "services.coordinator.step.ppo_step.xǁPPOStepǁ"
MANUAL[_STEP + "__init____mutmut_1"] = (
    "equivalent: `perf/throughput` divides by max(num_gpus, 1), so a default of 1 gives what 0 does"
)
for n in (11, 13, 15, 16):
    MANUAL[_STEP + f"__init____mutmut_{n}"] = (
        "label: the name of the phases' threads (seen in stack dumps only)"
    )
MANUAL[_STEP + "close__mutmut_1"] = (
    "equivalent: None is false like False (`shutdown` does not wait either way)"
)
MANUAL[_STEP + "update_critic__mutmut_1"] = (
    "equivalent: an assertion weakened that holds either way: the critic's update runs only with a critic, whose values the step always computes"
)
for n in (19, 21):
    MANUAL[_STEP + f"score__mutmut_{n}"] = (
        "equivalent (dtype): the reward client's scores are Python floats, for which torch's default dtype is float32"
    )
