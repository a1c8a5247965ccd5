"""Actor, critic and reference roles in the test process, on a one-rank FSDP world."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor
from trainer_helpers import make_batch, plain_log_probs, trainer_config

from meshrl.ragged import Ragged
from services.trainer.actor import ActorRole
from services.trainer.critic import CriticRole
from services.trainer.reference import RefRole

ACTOR_METRICS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
}


def _params(role) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in role.iter_full_params()}


def test_actor_log_probs_equal_a_plain_forward(world, tiny_model_dir):
    actor = ActorRole.build(trainer_config(tiny_model_dir), world)
    batch = make_batch(7, seed=1)
    logprobs, entropy = actor.compute_log_probs(batch, with_entropy=True)
    expected_lp, expected_ent = plain_log_probs(tiny_model_dir, batch, temperature=0.8)
    assert torch.equal(logprobs.offsets, batch.responses.offsets)
    torch.testing.assert_close(logprobs.values, expected_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.values, expected_ent, atol=1e-5, rtol=0)
    # An explicit temperature wins over the rollout's.
    at_one, none = actor.compute_log_probs(batch, temperature=1.0)
    torch.testing.assert_close(
        at_one.values, plain_log_probs(tiny_model_dir, batch, 1.0)[0], atol=1e-5, rtol=0
    )
    assert none is None


def test_positive_advantage_raises_that_tokens_log_prob(world, tiny_model_dir):
    actor = ActorRole.build(trainer_config(tiny_model_dir), world)
    batch = make_batch(4, seed=2)
    old, _ = actor.compute_log_probs(batch)
    advantages = torch.zeros_like(old.values)
    advantages[0] = 1.0  # only the first response token of row 0 is rewarded
    metrics = actor.update_policy(
        batch, old, old.with_values(advantages), None, None, global_step=1
    )
    new, _ = actor.compute_log_probs(batch)
    assert new.values[0] > old.values[0] + 1e-3
    assert ACTOR_METRICS <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert metrics["actor/pg_clipfrac"] == 0.0  # first mini-batch is on-policy, no clipping
    assert actor.update_count == 1


def test_gradient_accumulation_does_not_change_the_update(world, tiny_model_dir):
    # 9 rows, mini-batches of 4 rows: one micro-batch per mini-batch vs one per row.
    batch = make_batch(9, seed=3)
    results = []
    for micro in (4, 1):
        cfg = trainer_config(
            tiny_model_dir,
            [
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                "actor_rollout_ref.actor.ppo_epochs=2",
            ],
        )
        actor = ActorRole.build(cfg, world)
        old, _ = actor.compute_log_probs(batch)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        results.append((metrics, _params(actor)))
    (m_big, p_big), (m_small, p_small) = results
    for key in m_big:
        if key.startswith("perf/"):  # timings, not results
            continue
        assert m_big[key] == pytest.approx(m_small[key], abs=1e-5), key
    for name in p_big:
        torch.testing.assert_close(p_big[name], p_small[name], atol=1e-5, rtol=0)


def test_kl_loss_and_rollout_mismatch_metrics(world, tiny_model_dir):
    cfg = trainer_config(
        tiny_model_dir,
        [
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
        ],
    )
    actor = ActorRole.build(cfg, world)
    batch = make_batch(5, seed=4)
    old, _ = actor.compute_log_probs(batch)
    rollout = old.with_values(old.values + 0.05)
    adv = old.with_values(torch.ones_like(old.values))
    metrics = actor.update_policy(batch, old, adv, old, rollout, global_step=1)
    expected = ACTOR_METRICS | {
        "actor/kl_loss",
        "actor/kl_coef",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
    }
    assert expected <= set(metrics)
    assert metrics["actor/kl_coef"] == pytest.approx(0.001)
    assert metrics["training/rollout_probs_diff_mean"] > 0
    with pytest.raises(ValueError, match="no ref_logprobs"):
        actor.update_policy(batch, old, adv, None, None, global_step=2)
    with pytest.raises(ValueError, match="response tokens"):
        actor.update_policy(
            batch, old, Ragged.from_lists([[1.0]], dtype=torch.float32), old, None, 2
        )


def test_critic_starts_at_zero_and_learns_the_returns(world, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir, ["critic.cliprange_value=100.0"])
    critic = CriticRole.build(cfg, world)
    batch = make_batch(6, seed=5)
    values = critic.compute_values(batch)
    assert torch.equal(values.offsets, batch.responses.offsets)
    assert torch.count_nonzero(values.values) == 0  # zero-initialised value head
    returns = values.with_values(torch.linspace(0.5, 1.5, values.values.numel()))
    losses = []
    for step in range(1, 6):
        old = critic.compute_values(batch)
        metrics = critic.update_value(batch, old, returns, global_step=step)
        losses.append(metrics["critic/vf_loss"])
    assert {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
    } <= set(metrics)
    assert losses[-1] < 0.5 * losses[0]
    assert metrics["critic/vpred_mean"] > 0.1


def test_reference_is_frozen_and_scores_like_the_actor(world, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir)
    ref = RefRole.build(cfg, world)
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training
    batch = make_batch(5, seed=6)
    ref_lp, _ = ref.compute_log_probs(batch)
    actor_lp, _ = ActorRole.build(cfg, world).compute_log_probs(batch)
    torch.testing.assert_close(ref_lp.values, actor_lp.values, atol=1e-6, rtol=0)
    ref_lp_again, _ = ref.compute_log_probs(batch)
    assert torch.equal(ref_lp.values, ref_lp_again.values)


def test_checkpoint_round_trip_with_optimizer(world, tiny_model_dir, tmp_path):
    cfg = trainer_config(tiny_model_dir)
    batch = make_batch(4, seed=7)
    actor = ActorRole.build(cfg, world)
    old, _ = actor.compute_log_probs(batch)
    adv = old.with_values(torch.ones_like(old.values))
    actor.update_policy(batch, old, adv, None, None, global_step=1)
    actor.save(str(tmp_path / "ckpt"), with_optimizer=True)

    restored = ActorRole.build(cfg, world)
    restored.load(str(tmp_path / "ckpt"), with_optimizer=True)
    assert restored.update_count == 1
    for (name, a), (_, b) in zip(
        actor.iter_full_params(), restored.iter_full_params(), strict=True
    ):
        assert torch.equal(a, b), name
    # Same optimizer state: the next update is identical too.
    m1 = actor.update_policy(batch, old, adv, None, None, global_step=2)
    m2 = restored.update_policy(batch, old, adv, None, None, global_step=2)
    assert _results(m1) == pytest.approx(_results(m2), abs=1e-6)
    with pytest.raises(ValueError, match="not a trainer checkpoint"):
        restored.load(str(tmp_path), with_optimizer=False)


def test_gradient_checkpointing_changes_memory_not_results(world, tiny_model_dir):
    batch = make_batch(4, seed=8)
    results = []
    for checkpointing in ("false", "true"):
        cfg = trainer_config(
            tiny_model_dir,
            [f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}"],
        )
        actor = ActorRole.build(cfg, world)
        old, _ = actor.compute_log_probs(batch)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        results.append((old.values, metrics, _params(actor)))
    (lp_a, m_a, p_a), (lp_b, m_b, p_b) = results
    torch.testing.assert_close(lp_a, lp_b, atol=1e-6, rtol=0)
    assert _results(m_a) == pytest.approx(_results(m_b), abs=1e-5)
    for name in p_a:
        torch.testing.assert_close(p_a[name], p_b[name], atol=1e-5, rtol=0)


def _results(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics that are results, not timings (perf/* differ from run to run)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _all_masters(actor) -> bool:
    return all(
        isinstance(p, DTensor) and p.dtype == torch.float32 for p in actor.model.parameters()
    )


def test_one_shard_unit_for_the_model_trains_like_one_per_layer(world, tiny_model_dir, monkeypatch):
    # MESHRL_FSDP_UNITS=model drops the per-layer units: fewer hooks, the same update.
    batch = make_batch(6, seed=4)
    results = []
    for units in ("layer", "model"):
        monkeypatch.setenv("MESHRL_FSDP_UNITS", units)
        actor = ActorRole.build(trainer_config(tiny_model_dir), world)
        layers = actor.model.model.layers
        assert (type(layers[0]).__name__.startswith("FSDP")) == (units == "layer")
        old, _ = actor.compute_log_probs(batch)
        # One unit keeps its gathered bf16 weights from forward to backward. On one rank
        # they also stay from the old-log-prob pass into the update; the update frees
        # them at its end: the parameters are the float32 master shards again.
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        assert _all_masters(actor)
        results.append((old.values, metrics["actor/grad_norm"], _params(actor)))
    (lp_layer, norm_layer, p_layer), (lp_model, norm_model, p_model) = results
    torch.testing.assert_close(lp_model, lp_layer, atol=1e-6, rtol=0)
    assert norm_model == pytest.approx(norm_layer, rel=1e-5)
    for name in p_layer:
        torch.testing.assert_close(p_model[name], p_layer[name], atol=1e-6, rtol=0)
    monkeypatch.setenv("MESHRL_FSDP_UNITS", "blocks")
    with pytest.raises(ValueError, match="FSDP units 'blocks'"):
        ActorRole.build(trainer_config(tiny_model_dir), world)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_kept_gathered_across_mini_batches_train_like_gathering_again(
    world, tiny_model_dir, monkeypatch, dtype
):
    # One rank: the gathered weights outlive the old-log-prob pass and each backward, and
    # are refreshed from the stepped masters (fsdp.gathered_across_steps) instead of
    # gathered again. 8 rows in mini-batches of 4, two epochs: four optimizer steps.
    from services.trainer.fsdp import sharding as fsdp

    monkeypatch.setenv("MESHRL_FSDP_UNITS", "model")
    overrides = ["actor_rollout_ref.actor.ppo_epochs=2", f"actor_rollout_ref.model.dtype={dtype}"]
    batch = make_batch(8, seed=6)
    copy = fsdp._copy_masters_to_gathered

    def internals_renamed(modules):
        raise AttributeError("'FSDPModule' object has no attribute '_get_fsdp_state'")

    def run(keep: bool, refresh: bool = True, copy=copy):
        monkeypatch.setattr(fsdp, "KEEP_GATHERED_ON_ONE_RANK", keep)
        monkeypatch.setattr(
            fsdp, "_copy_masters_to_gathered", copy if refresh else lambda modules: None
        )
        actor = ActorRole.build(trainer_config(tiny_model_dir, overrides), world)
        metrics = []
        for step in (1, 2):
            old, _ = actor.compute_log_probs(batch)
            assert _all_masters(actor) != keep  # kept for the update
            adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
            metrics.append(actor.update_policy(batch, old, adv, None, None, global_step=step))
            assert _all_masters(actor)  # freed when the update ends
        return [_results(m) for m in metrics], _params(actor)

    gathered_again, kept, stale = run(False), run(True), run(True, refresh=False)
    assert kept[0] == gathered_again[0]
    for name, value in gathered_again[1].items():
        assert torch.equal(kept[1][name], value), name
    # Without the refresh, later mini-batches would run on the weights before the step.
    assert stale[0] != gathered_again[0]
    # FSDP2's internals renamed (a torch release): the refresh falls back to gathering again.
    fallback = run(True, copy=internals_renamed)
    assert fallback[0] == gathered_again[0]
    for name, value in gathered_again[1].items():
        assert torch.equal(fallback[1][name], value), name


def test_seq_mean_token_sum_norm_divides_by_max_response_length(world, tiny_model_dir):
    # Dr. GRPO's T is a constant, data.max_response_length (8 here), for both roles; the
    # critic used to divide by the batch's longest response instead (a T that changed from
    # step to step). One mini-batch of 4 rows, epochs 1: the metric is the loss before the
    # step. By hand: actor, ratio 1 and A = 1: every token's loss is -1; critic, values 0
    # (zero head) and returns 1: 0.5 * (0 - 1)^2 per token. Both sums over N_seq * T.
    mode = "seq-mean-token-sum-norm"
    cfg = trainer_config(
        tiny_model_dir,
        [f"actor_rollout_ref.actor.loss_agg_mode={mode}", f"critic.loss_agg_mode={mode}"],
    )
    batch = make_batch(4, seed=9)
    n_tokens, longest = batch.num_response_tokens, int(batch.response_lengths.max())
    assert longest < cfg.data.max_response_length
    per_seq_and_t = 4 * cfg.data.max_response_length

    actor = ActorRole.build(cfg, world)
    old, _ = actor.compute_log_probs(batch)
    adv = old.with_values(torch.ones_like(old.values))
    metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
    assert metrics["actor/pg_loss"] == pytest.approx(-n_tokens / per_seq_and_t, rel=1e-6)

    critic = CriticRole.build(cfg, world)
    values = critic.compute_values(batch)
    returns = values.with_values(torch.ones_like(values.values))
    metrics = critic.update_value(batch, values, returns, global_step=1)
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * n_tokens / per_seq_and_t, rel=1e-6)


def test_actor_lr_schedule_starts_at_its_first_update_after_critic_warmup(world, tiny_model_dir):
    # critic_warmup=2: steps 1 and 2 train only the critic, the actor first updates at step
    # 3. Its warm-up (4 updates) starts there, as verl's scheduler counts the actor's own
    # updates; it used to count PPO steps, so the first update ran at 3/4 of the lr.
    overrides = [
        "critic.critic_warmup=2",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
        "critic.optim.lr_warmup_steps=4",
    ]
    cfg = trainer_config(tiny_model_dir, overrides)
    batch = make_batch(4, seed=10)
    actor = ActorRole.build(cfg, world)
    old, _ = actor.compute_log_probs(batch)
    adv = old.with_values(torch.ones_like(old.values))
    lrs = [
        actor.update_policy(batch, old, adv, None, None, global_step=step)["actor/lr"]
        for step in (3, 4)
    ]
    assert lrs == pytest.approx([1e-3 / 4, 1e-3 / 2])
    # The critic trains from step 1: its schedule is not shifted.
    critic = CriticRole.build(cfg, world)
    values = critic.compute_values(batch)
    metrics = critic.update_value(batch, values, values, global_step=1)
    assert metrics["critic/lr"] == pytest.approx(1e-2 / 4)


def test_gspo_first_update_is_ppo_at_ratio_one_and_accumulates_like_one_micro_batch(
    world, tiny_model_dir
):
    # On-policy (one epoch, one mini-batch) every ratio is 1: GSPO's gradient is then
    # vanilla PPO's under seq-mean-token-mean. Later epochs are off-policy, where the two
    # differ; there the split into micro-batches must still not change the update.
    batch = make_batch(8, seed=5)
    one_step = ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]  # prompts: all 8 rows
    gspo = ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]
    vanilla = ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]

    def update(overrides):
        actor = ActorRole.build(trainer_config(tiny_model_dir, overrides), world)
        old, _ = actor.compute_log_probs(batch)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        return metrics, _params(actor)

    (_, p_gspo), (_, p_ppo) = update([*one_step, *gspo]), update([*one_step, *vanilla])
    for name in p_gspo:
        torch.testing.assert_close(p_gspo[name], p_ppo[name], atol=1e-6, rtol=0)
    two_epochs = ["actor_rollout_ref.actor.ppo_epochs=2", *gspo]
    m_big, p_big = update([*two_epochs, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    m_small, p_small = update(
        [*two_epochs, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    )
    assert m_big["actor/pg_loss"] == pytest.approx(m_small["actor/pg_loss"], abs=1e-5)
    for name in p_big:
        torch.testing.assert_close(p_big[name], p_small[name], atol=1e-5, rtol=0)


def _policy_update(world, model_dir, batch, overrides, advantages=None, shift=0.0):
    """A fresh actor's first update of ``batch`` (advantages: a linspace over its tokens),
    with old log-probs lowered by ``shift``: every ratio starts near ``exp(shift)``."""
    actor = ActorRole.build(trainer_config(model_dir, overrides), world)
    old, _ = actor.compute_log_probs(batch)
    if advantages is None:
        advantages = torch.linspace(-1, 1, old.values.numel())
    old, adv = old.with_values(old.values - shift), old.with_values(advantages)
    metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
    return metrics, _params(actor)


def test_geo_mean_first_update_is_ppo_at_ratio_one_and_accumulates_like_one_micro_batch(
    world, tiny_model_dir
):
    # On-policy with one advantage a response (as an outcome estimator gives), GMPO's
    # gradient is vanilla PPO's under seq-mean-token-mean: -A_i / (N |y_i|) on each token.
    # The default token-mean weighs responses otherwise, which a run ignoring the mode would
    # take. Later epochs are off-policy; the split into micro-batches must not matter there.
    batch = make_batch(8, seed=6)
    per_response = torch.linspace(-1, 1, len(batch)).repeat_interleave(batch.response_lengths)
    one_step = ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]  # prompts: all 8 rows
    geo_mean = ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"]
    vanilla = ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]

    def update(overrides):
        return _policy_update(world, tiny_model_dir, batch, overrides, per_response)

    (_, p_geo), (_, p_ppo) = update([*one_step, *geo_mean]), update([*one_step, *vanilla])
    for name in p_geo:
        torch.testing.assert_close(p_geo[name], p_ppo[name], atol=1e-6, rtol=0)
    two_epochs = ["actor_rollout_ref.actor.ppo_epochs=2", *one_step, *geo_mean]
    m_big, p_big = update([*two_epochs, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    m_small, p_small = update(
        [*two_epochs, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    )
    assert m_big["actor/pg_loss"] == pytest.approx(m_small["actor/pg_loss"], abs=1e-5)
    for name in p_big:
        torch.testing.assert_close(p_big[name], p_small[name], atol=1e-5, rtol=0)


def test_clip_cov_holds_tokens_back_and_a_seed_draws_the_same_ones(world, tiny_model_dir):
    # One on-policy update (no PPO clipping), bounds wide enough for every token to be a
    # candidate. A ratio of 1 holds every token back: no policy loss, pg_clipfrac 1. A ratio
    # of 0.3 draws some of each micro-batch (a row): trainer.seed draws the same tokens
    # again, another seed others. No shuffle: the seed then only seeds the draw.
    batch = make_batch(8, seed=7)
    clip_cov = [
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.shuffle=false",
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb=-1e9",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ub=1e9",
    ]

    def update(*overrides):
        adv = torch.linspace(-0.5, 1, batch.num_response_tokens)  # PPO's loss is not 0
        return _policy_update(world, tiny_model_dir, batch, [*clip_cov, *overrides], adv)

    m_all, _ = update("actor_rollout_ref.actor.policy_loss.clip_cov_ratio=1")
    assert m_all["actor/pg_loss"] == 0.0
    assert m_all["actor/pg_clipfrac"] == pytest.approx(1.0)
    some = "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.3"
    (m_a, p_a), (_, p_b) = update(some), update(some)
    _, p_other = update(some, "trainer.seed=2")
    assert 0 < m_a["actor/pg_clipfrac"] < 1
    assert all(torch.equal(p_a[name], p_b[name]) for name in p_a)
    assert not all(torch.equal(p_a[name], p_other[name]) for name in p_a)


def test_kl_cov_penalises_the_log_ratio_and_accumulates_like_one_micro_batch(world, tiny_model_dir):
    # Old log-probs 0.1 below the policy's: every log-ratio starts at 0.1, not at the noise
    # around 0 of an on-policy update, where |log r|'s gradient would take the noise's sign.
    # Without its penalty KL-Cov is PPO without any clip. With it, on every token
    # (kl_cov_ratio 1, so that no split can choose otherwise), the update differs and does
    # not depend on the split into micro-batches; ppo_kl is verl's mean |log r| of this mode.
    batch = make_batch(8, seed=8)
    one_step = ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    kl_cov = [
        *one_step,
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=1",
    ]
    no_clip = [
        "actor_rollout_ref.actor.clip_ratio_low=1",
        "actor_rollout_ref.actor.clip_ratio_high=1e9",
        "actor_rollout_ref.actor.clip_ratio_c=1e9",
    ]

    def update(*overrides):
        return _policy_update(world, tiny_model_dir, batch, list(overrides), shift=0.1)

    (_, p_free), (_, p_ppo) = (
        update(*kl_cov, "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0"),
        update(*one_step, *no_clip),
    )
    for name in p_free:
        torch.testing.assert_close(p_free[name], p_ppo[name], atol=1e-6, rtol=0)
    penalised = [*kl_cov, "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1"]
    m_big, p_big = update(*penalised, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    m_small, p_small = update(*penalised, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    assert m_big["actor/pg_loss"] == pytest.approx(m_small["actor/pg_loss"], abs=1e-5)
    for name in p_big:
        torch.testing.assert_close(p_big[name], p_small[name], atol=1e-5, rtol=0)
    assert max((p_small[n] - p_free[n]).abs().max().item() for n in p_free) > 1e-5
    assert m_small["actor/ppo_kl"] == pytest.approx(0.1, abs=1e-4)


def test_a_reference_offloaded_on_the_cpu_is_the_same_reference(world, tiny_model_dir):
    """trainer.device=cpu: its weights are in CPU memory anyway; nothing changes."""
    batch = make_batch(5, seed=6)
    plain = RefRole.build(trainer_config(tiny_model_dir), world)
    offload = ["actor_rollout_ref.ref.param_offload=true"]
    offloaded = RefRole.build(trainer_config(tiny_model_dir, offload), world)
    torch.testing.assert_close(
        offloaded.compute_log_probs(batch)[0].values, plain.compute_log_probs(batch)[0].values
    )
