"""Each term of the actor's and the critic's loss, pinned by what it must do to one update:
hand-worked metric values and the direction of one optimizer step, on a one-rank FSDP
world in the test process. Unlike the equivalence tests (one rank vs two, packed vs
padded), these fail when a term is assembled wrongly in the same way everywhere.

One batch of 4 rows is one mini-batch (ppo_mini_batch_size 2 x rollout.n 2), one epoch:
one optimizer step, and the metrics are the loss terms before it (at ratio 1, since the
old log-probs are the actor's own)."""

import math

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.algorithms.loss_modes import vanilla
from meshrl.ragged import Ragged
from services.trainer.actor import ActorRole, PolicyLossSettings
from services.trainer.critic import CriticRole


def _actor(world, model_dir, overrides):
    return ActorRole.build(trainer_config(model_dir, overrides), world)


def _token_mean(values: torch.Tensor) -> float:
    return float(values.double().mean())


@pytest.mark.parametrize("coeff", [0.1, 1.0])
def test_entropy_bonus_raises_the_entropy(world, tiny_model_dir, coeff):
    # Advantages 0: the policy-gradient term is 0 and so is its gradient, so the loss is
    # -entropy_coeff * H alone. Minimising it must raise the entropy of every position's
    # next-token distribution (on average over the response tokens).
    actor = _actor(world, tiny_model_dir, [f"actor_rollout_ref.actor.entropy_coeff={coeff}"])
    batch = make_batch(4, seed=11)
    old, entropy_before = actor.compute_log_probs(batch, with_entropy=True)
    zeros = old.with_values(torch.zeros_like(old.values))
    metrics = actor.update_policy(batch, old, zeros, None, None, global_step=1)
    assert metrics["actor/pg_loss"] == 0.0
    assert metrics["actor/entropy"] == pytest.approx(_token_mean(entropy_before.values), rel=1e-5)
    _, entropy_after = actor.compute_log_probs(batch, with_entropy=True)
    assert _token_mean(entropy_after.values) > _token_mean(entropy_before.values) + 1e-4


def test_without_any_loss_term_the_update_changes_nothing(world, tiny_model_dir):
    # The control of the test above: advantages 0 and no entropy bonus, no KL loss.
    actor = _actor(world, tiny_model_dir, [])
    batch = make_batch(4, seed=11)
    old, _ = actor.compute_log_probs(batch)
    zeros = old.with_values(torch.zeros_like(old.values))
    actor.update_policy(batch, old, zeros, None, None, global_step=1)
    new, _ = actor.compute_log_probs(batch)
    torch.testing.assert_close(new.values, old.values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("ref_shift, direction", [(0.5, 1), (-0.5, -1)])
def test_kl_loss_pulls_each_log_prob_towards_the_reference(
    world, tiny_model_dir, ref_shift, direction
):
    # Advantages 0, no entropy bonus: the loss is kl_loss_coef * k3(log pi, log pi_ref), whose
    # gradient in log pi is 1 - exp(log pi_ref - log pi) = 1 - exp(ref_shift): negative when
    # the reference gives the sampled tokens more probability (ref_shift 0.5), so the step
    # raises their log-probs, positive (it lowers them) when the reference gives less.
    actor = _actor(
        world,
        tiny_model_dir,
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.kl_loss_coef=1.0",
        ],
    )
    batch = make_batch(4, seed=12)
    old, _ = actor.compute_log_probs(batch)
    ref = old.with_values(old.values + ref_shift)
    zeros = old.with_values(torch.zeros_like(old.values))
    metrics = actor.update_policy(batch, old, zeros, ref, None, global_step=1)
    # k3 = exp(d) - d - 1 with d = log pi_ref - log pi = ref_shift, on every token.
    k3 = math.exp(ref_shift) - ref_shift - 1
    assert metrics["actor/kl_loss"] == pytest.approx(k3, rel=1e-4)
    new, _ = actor.compute_log_probs(batch)
    moved = _token_mean(new.values) - _token_mean(old.values)
    assert direction * moved > 1e-4


@pytest.mark.parametrize(
    "rollout_shift, cap, weight",
    [
        (-math.log(2.0), 3.0, 2.0),  # the engine gave the tokens half the trainer's probability
        (math.log(2.0), 3.0, 0.5),  # twice the trainer's probability
        (-math.log(5.0), 3.0, 3.0),  # 5, truncated at the cap
        (-math.log(2.0), 0.5, 0.5),  # a cap below 1 is a cap too
    ],
)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "geo_mean", "clip_cov", "kl_cov"])
def test_is_correction_weighs_each_token_by_old_over_rollout_probability(
    world, tiny_model_dir, rollout_shift, cap, weight, loss_mode
):
    # Truncated IS: w = min(pi_old / pi_rollout, cap), the same on every token. At ratio 1
    # with advantage 1 each token's loss is -A * w = -w, and so is every mode's mean (GSPO
    # and GMPO take one weight a response, the geometric mean of its tokens': w; Clip-Cov
    # drops no token of so few, KL-Cov penalises none at ratio 1).
    actor = _actor(
        world,
        tiny_model_dir,
        [
            f"actor_rollout_ref.actor.tis_imp_ratio_cap={cap}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        ],
    )
    batch = make_batch(4, seed=13)
    old, _ = actor.compute_log_probs(batch)
    rollout = old.with_values(old.values + rollout_shift)
    ones = old.with_values(torch.ones_like(old.values))
    metrics = actor.update_policy(batch, old, ones, None, rollout, global_step=1)
    assert metrics["actor/pg_loss"] == pytest.approx(-weight, rel=1e-5)


def test_positive_advantage_and_is_weight_raise_the_log_prob(world, tiny_model_dir):
    # The sign of the policy-gradient term through the IS weight: advantage 1 on every
    # token, weights 2, one step raises the sampled tokens' log-probs.
    actor = _actor(world, tiny_model_dir, ["actor_rollout_ref.actor.tis_imp_ratio_cap=3.0"])
    batch = make_batch(4, seed=13)
    old, _ = actor.compute_log_probs(batch)
    rollout = old.with_values(old.values - math.log(2.0))
    ones = old.with_values(torch.ones_like(old.values))
    actor.update_policy(batch, old, ones, None, rollout, global_step=1)
    new, _ = actor.compute_log_probs(batch)
    assert _token_mean(new.values) > _token_mean(old.values) + 1e-4


@pytest.mark.parametrize(
    "old_value, cliprange, vf_loss, clipfrac, moves",
    [
        # v = 0 (zero head), R = -1. Unclipped: 0.5 * (0 + 1)^2 = 0.5.
        (0.0, 0.2, 0.5, 0.0, True),
        # v_old = 0.5: v_clip = clamp(0, 0.3, 0.7) = 0.3, 0.5 * (0.3 + 1)^2 = 0.845 > 0.5:
        # the clipped branch is taken, and its gradient in v is 0 (v outside the clamp).
        (0.5, 0.2, 0.845, 1.0, False),
        # A wide clip range: clamp(0, -99.5, 100.5) = 0, unclipped again.
        (0.5, 100.0, 0.5, 0.0, True),
    ],
)
def test_value_clipping_by_hand(
    world, tiny_model_dir, old_value, cliprange, vf_loss, clipfrac, moves
):
    cfg = trainer_config(tiny_model_dir, [f"critic.cliprange_value={cliprange}"])
    critic = CriticRole.build(cfg, world)
    batch = make_batch(4, seed=14)
    values = critic.compute_values(batch)
    assert torch.count_nonzero(values.values) == 0
    old = values.with_values(torch.full_like(values.values, old_value))
    returns = values.with_values(torch.full_like(values.values, -1.0))
    metrics = critic.update_value(batch, old, returns, global_step=1)
    assert metrics["critic/vf_loss"] == pytest.approx(vf_loss, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipfrac)
    after = critic.compute_values(batch)
    if moves:  # towards the return -1
        assert _token_mean(after.values) < -1e-4
    else:
        assert torch.count_nonzero(after.values) == 0


@pytest.mark.parametrize("wrong", ["old_values", "returns"])
def test_critic_names_the_input_of_the_wrong_length(world, tiny_model_dir, wrong):
    critic = CriticRole.build(trainer_config(tiny_model_dir), world)
    batch = make_batch(4, seed=15)
    n = batch.num_response_tokens
    right = Ragged.from_tensors([torch.zeros(int(k)) for k in batch.response_lengths])
    short = Ragged.from_lists([[0.0]], dtype=torch.float32)
    args = {"old_values": right, "returns": right, wrong: short}
    with pytest.raises(ValueError, match=f"^{wrong} has 1 values for {n} response tokens$"):
        critic.update_value(batch, args["old_values"], args["returns"], global_step=1)


@pytest.mark.parametrize(
    "wrong", ["old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"]
)
def test_actor_names_the_input_of_the_wrong_length(world, tiny_model_dir, wrong):
    actor = _actor(world, tiny_model_dir, ["actor_rollout_ref.actor.use_kl_loss=true"])
    batch = make_batch(4, seed=15)
    n = batch.num_response_tokens
    right = Ragged.from_tensors([torch.zeros(int(k)) for k in batch.response_lengths])
    args = dict.fromkeys(["old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"], right)
    args[wrong] = Ragged.from_lists([[0.0]], dtype=torch.float32)
    with pytest.raises(ValueError, match=f"^{wrong} has 1 values for {n} response tokens$"):
        actor.update_policy(batch, global_step=1, **args)


def test_kl_loss_without_reference_log_probs_is_refused(world, tiny_model_dir):
    actor = _actor(world, tiny_model_dir, ["actor_rollout_ref.actor.use_kl_loss=true"])
    batch = make_batch(4, seed=15)
    old, _ = actor.compute_log_probs(batch)
    with pytest.raises(
        ValueError, match="^use_kl_loss is set but the request has no ref_logprobs$"
    ):
        actor.update_policy(batch, old, old, None, None, global_step=1)


def test_critic_reports_the_mean_prediction_over_its_micro_batches(world, tiny_model_dir):
    # Two micro-batches of 2 rows a mini-batch: each adds its token mean times its share of
    # the tokens, which sums to the mean over all tokens. A first step moves the values off
    # the zero head; the second update's metric is the mean of the values before it.
    critic = CriticRole.build(trainer_config(tiny_model_dir), world)
    batch = make_batch(4, seed=16)
    values = critic.compute_values(batch)
    returns = values.with_values(torch.full_like(values.values, -1.0))
    critic.update_value(batch, values, returns, global_step=1)
    moved = critic.compute_values(batch)
    assert _token_mean(moved.values) < -1e-4
    metrics = critic.update_value(batch, moved, returns, global_step=2)
    assert metrics["critic/vpred_mean"] == pytest.approx(_token_mean(moved.values), rel=1e-4)


def test_policy_loss_settings_take_each_value_from_its_own_key(tiny_model_dir):
    # Every setting a different number, so a value read from the wrong key shows.
    keys = {
        "clip_ratio_low": 0.11,
        "clip_ratio_high": 0.12,
        "clip_ratio_c": 3.3,
        "entropy_coeff": 0.014,
        "kl_loss_coef": 0.015,
        "tis_imp_ratio_cap": 1.6,
    }
    policy = {
        "clip_cov_ratio": 0.0017,
        "clip_cov_lb": 1.8,
        "clip_cov_ub": 1.9,
        "kl_cov_ratio": 0.002,
        "ppo_kl_coef": 0.21,
    }
    overrides = [f"actor_rollout_ref.actor.{k}={v}" for k, v in keys.items()]
    overrides += [f"actor_rollout_ref.actor.policy_loss.{k}={v}" for k, v in policy.items()]
    overrides += [
        "actor_rollout_ref.actor.clip_ratio=0.3",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=mse",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "trainer.seed=23",
    ]
    settings = PolicyLossSettings.from_config(trainer_config(tiny_model_dir, overrides))
    assert {k: getattr(settings, k) for k in keys} == keys
    assert {k: getattr(settings, k) for k in policy} == policy
    assert settings.use_kl_loss and settings.kl_loss_type == "mse"
    assert settings.loss_agg_mode == "seq-mean-token-sum" and settings.loss_mode == "kl_cov"
    assert settings.loss_width == 8 and settings.seed == 23  # data.max_response_length
    # clip_ratio stands in for an unset side only
    only_high = trainer_config(
        tiny_model_dir,
        ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.12"],
    )
    settings = PolicyLossSettings.from_config(only_high)
    assert (settings.clip_ratio_low, settings.clip_ratio_high) == (0.3, 0.12)


@pytest.mark.parametrize(
    "loss_mode, log_ratio, advantage, overrides, pg_loss",
    [
        # A > 0, ratio e^0.5 = 1.65: clipped at 1 + clip_ratio_high = 1.1, loss -1.1 a token
        ("vanilla", 0.5, 1.0, ["actor_rollout_ref.actor.clip_ratio_high=0.1"], -1.1),
        ("clip_cov", 0.5, 1.0, ["actor_rollout_ref.actor.clip_ratio_high=0.1"], -1.1),
        # A < 0, ratio e^2 = 7.4: PPO's loss 7.4 a token, the dual clip caps it at c = 2
        ("vanilla", 2.0, -1.0, ["actor_rollout_ref.actor.clip_ratio_c=2.0"], 2.0),
    ],
)
def test_the_configured_clip_ratios_reach_the_loss(
    world, tiny_model_dir, loss_mode, log_ratio, advantage, overrides, pg_loss
):
    # Old log-probs lowered by log_ratio: every token's ratio starts at e^log_ratio.
    cfg = [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *overrides]
    actor = _actor(world, tiny_model_dir, cfg)
    batch = make_batch(4, seed=17)
    old, _ = actor.compute_log_probs(batch)
    shifted = old.with_values(old.values - log_ratio)
    adv = old.with_values(torch.full_like(old.values, advantage))
    metrics = actor.update_policy(batch, shifted, adv, None, None, global_step=1)
    assert metrics["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-4)


def test_a_loss_that_draws_or_needs_the_rollouts_log_probs_is_given_them(world, tiny_model_dir):
    # What a registry entry declares (meshrl/algorithms/registry.py) is what its function
    # gets: here vanilla's entry declared as drawing and needing the behaviour log-probs.
    import dataclasses

    actor = _actor(world, tiny_model_dir, [])
    actor.loss_entry = dataclasses.replace(
        actor.loss_entry, draws=True, needs_behaviour_logprobs=True
    )
    seen = []

    def recording(inputs, settings):
        seen.append(inputs)
        return vanilla(inputs, settings)

    actor.loss_fn = recording
    batch = make_batch(4, seed=19)
    old, _ = actor.compute_log_probs(batch)
    adv = old.with_values(torch.ones_like(old.values))
    with pytest.raises(ValueError, match=r"loss_mode=vanilla needs the rollout's log-probs"):
        actor.update_policy(batch, old, adv, None, None, global_step=1)
    rollout = old.with_values(old.values - 0.25)
    actor.update_policy(batch, old, adv, None, rollout, global_step=1)
    assert seen and all(isinstance(x.generator, torch.Generator) for x in seen)
    for x in seen:  # each micro-batch's rows of the rollout's log-probs, under its mask
        torch.testing.assert_close(
            x.behaviour_logprobs[x.mask], x.old_logprobs[x.mask] - 0.25, rtol=0, atol=1e-6
        )
