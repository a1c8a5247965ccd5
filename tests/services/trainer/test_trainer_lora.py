"""LoRA adapters on the actor and critic (``model.lora_rank``), on a one-rank FSDP world."""

import pytest
import torch
from trainer_helpers import make_batch, plain_log_probs, trainer_config
from transformers import AutoModelForCausalLM, GPT2Config

from meshrl.config.sections import ModelConfig
from services.trainer.actor import ActorRole
from services.trainer.checkpoint import load_checkpoint, save_checkpoint
from services.trainer.critic import CriticRole
from services.trainer.fsdp.sharding import reshard
from services.trainer.lora import add_lora, hf_name, merged_weight
from services.trainer.mfu import matmul_params, weighted_matmul_params
from services.trainer.reference import RefRole

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


def _update(actor, batch, step=1):
    old, _ = actor.compute_log_probs(batch)
    advantages = torch.zeros_like(old.values)
    advantages[0] = 1.0  # only the first response token of row 0 is rewarded
    actor.update_policy(batch, old, old.with_values(advantages), None, None, global_step=step)
    return old


def _frozen(model) -> dict[str, torch.Tensor]:
    """Full copies of the parameters that are not trained (the float32 masters)."""
    reshard(model)
    return {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _trained_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_a_fresh_adapter_leaves_the_base_model_and_only_adapters_train(world, tiny_model_dir):
    actor = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = _trained_names(actor.model)
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # Every linear layer of both decoder layers (7 each), none on the LM head.
    assert len(trained) == 2 * 7 * 2
    assert not any(n.startswith("lm_head") for n in trained)
    assert actor.num_parameters == base.num_parameters()  # the model's size, adapters aside
    optimized = [p for g in actor.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == sum(
        p.numel() for n, p in actor.model.named_parameters() if n in trained
    )

    # Outside the trainer: the base model's names, shapes and (B = 0) values.
    full = dict(actor.iter_full_params())
    assert [n for n, _ in actor.named_param_shapes()] == list(full)
    expected = dict(base.named_parameters())
    assert set(full) == set(expected)
    for name, tensor in full.items():
        assert torch.equal(tensor, expected[name].detach()), name


def test_an_update_moves_only_the_adapters_and_the_merged_weights_are_the_policy(
    world, tiny_model_dir
):
    actor = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    frozen_before = _frozen(actor.model)
    batch = make_batch(4, seed=2)
    old = _update(actor, batch)
    new, _ = actor.compute_log_probs(batch)
    assert new.values[0] > old.values[0] + 1e-3
    frozen_after = _frozen(actor.model)
    for name, before in frozen_before.items():
        assert torch.equal(frozen_after[name], before), f"{name} moved"

    # What rollout receives: a plain Hugging Face model with the merged weights gives the
    # adapted actor's log-probs.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    merged = dict(actor.iter_full_params())
    moved = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved)  # the adapted layers
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain.load_state_dict(merged)
    torch.testing.assert_close(
        plain_log_probs(plain, batch, temperature=0.8)[0], new.values, atol=1e-5, rtol=0
    )


def test_merged_weight_is_base_plus_scaled_b_a():
    base, a, b = torch.randn(5, 3), torch.randn(2, 3), torch.randn(5, 2)
    torch.testing.assert_close(merged_weight(base, a, b, 1.5), base + 1.5 * b @ a)
    assert merged_weight(base.bfloat16(), a, b, 1.0).dtype == torch.bfloat16
    assert (
        hf_name("model.layers.0.mlp.up_proj.base_layer.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("model.layers.0.mlp.up_proj.lora_A.default.weight") is None
    assert hf_name("lm_head.weight") == "lm_head.weight"


def test_lora_checkpoint_round_trip_and_a_mismatch_is_refused(world, tiny_model_dir, tmp_path):
    cfg = trainer_config(tiny_model_dir, LORA)
    batch = make_batch(4, seed=7)
    actor = ActorRole.build(cfg, world)
    _update(actor, batch)
    actor.save(str(tmp_path / "ckpt"), with_optimizer=True)

    restored = ActorRole.build(cfg, world)
    restored.load(str(tmp_path / "ckpt"), with_optimizer=True)
    for (name, a), (_, b) in zip(
        actor.iter_full_params(), restored.iter_full_params(), strict=True
    ):
        assert torch.equal(a, b), name
    m1 = _update(actor, batch, step=2)
    m2 = _update(restored, batch, step=2)
    assert torch.equal(m1.values, m2.values)

    full_model = ActorRole.build(trainer_config(tiny_model_dir), world)
    with pytest.raises(ValueError, match=r"LoRA adapters of rank 4.*no LoRA adapters"):
        full_model.load(str(tmp_path / "ckpt"), with_optimizer=False)
    other_rank = ActorRole.build(
        trainer_config(tiny_model_dir, ["actor_rollout_ref.model.lora_rank=2"]), world
    )
    with pytest.raises(ValueError, match="rank 4.*rank 2"):
        other_rank.load(str(tmp_path / "ckpt"), with_optimizer=False)


def test_critic_adapters_train_with_its_whole_value_head(world, tiny_model_dir):
    cfg = trainer_config(
        tiny_model_dir, ["critic.model.lora_rank=4", "critic.cliprange_value=100.0"]
    )
    critic = CriticRole.build(cfg, world)
    trained = _trained_names(critic.model)
    assert {"value_head.weight", "value_head.bias"} <= trained
    assert all(n.startswith("value_head.") or ".lora_" in n for n in trained)
    batch = make_batch(6, seed=5)
    returns = None
    losses = []
    for step in range(1, 6):
        old = critic.compute_values(batch)
        if returns is None:
            returns = old.with_values(torch.linspace(0.5, 1.5, old.values.numel()))
        losses.append(critic.update_value(batch, old, returns, global_step=step)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0]
    # The decoder's adapters moved too (B starts at zero), not only the head.
    lora_b = [p for n, p in critic.model.named_parameters() if ".lora_B." in n]
    assert lora_b and any(torch.count_nonzero(p.detach()) > 0 for p in lora_b)


@pytest.mark.parametrize(
    "targets, message",
    [
        ("[nope_proj]", r"actor_rollout_ref\.model\.target_modules=\['nope_proj'\]: .*nope_proj"),
        ("[lm_head]", "adapter on lm_head"),
        # peft would put embedding adapters (lora_embedding_A/B) there: not merged here
        ("[embed_tokens,q_proj]", r"adapter on model\.embed_tokens \(Embedding\).*linear"),
    ],
)
def test_target_modules_that_miss_or_hit_the_lm_head_are_refused(
    world, tiny_model_dir, targets, message
):
    cfg = trainer_config(
        tiny_model_dir, [*LORA, f"actor_rollout_ref.model.target_modules={targets}"]
    )
    with pytest.raises(ValueError, match=message):
        ActorRole.build(cfg, world)


def test_frozen_weights_count_two_thirds_in_the_mfu(world, tiny_model_dir):
    actor = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    frozen = matmul_params(actor.model, frozen_only=True)
    total = matmul_params(actor.model)
    assert 0 < frozen < total
    assert weighted_matmul_params(actor.model) == pytest.approx(total - frozen / 3)
    full = ActorRole.build(trainer_config(tiny_model_dir), world)
    assert weighted_matmul_params(full.model) == matmul_params(full.model)


def test_adapters_are_drawn_from_the_run_seed_and_leave_the_callers_random_stream(
    world, tiny_model_dir
):
    def lora_a(seed):
        cfg = trainer_config(tiny_model_dir, [*LORA, f"trainer.seed={seed}"])
        model = ActorRole.build(cfg, world).model
        reshard(model)
        return {n: p.full_tensor() for n, p in model.named_parameters() if ".lora_A." in n}

    state = torch.random.get_rng_state()
    first, again, other = lora_a(1), lora_a(1), lora_a(2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[n], again[n]) for n in first)  # what every FSDP rank draws
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_a_lora_actor_serves_its_base_model_as_the_reference(world, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir, [*LORA, "actor_rollout_ref.actor.use_kl_loss=true"])
    assert cfg.ref_in_actor and not cfg.use_ref_server  # no reference server is started
    actor = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    batch = make_batch(4, seed=2)
    _update(actor, batch)  # the adapters moved: the policy is no longer the base model
    policy, _ = actor.compute_log_probs(batch)
    base, _ = actor.compute_log_probs(batch, base_model=True)
    reference, _ = RefRole.build(cfg, world).compute_log_probs(batch)
    torch.testing.assert_close(base.values, reference.values, atol=1e-5, rtol=0)
    assert (policy.values - base.values).abs().max() > 1e-3
    again, _ = actor.compute_log_probs(batch)  # the adapters are on again
    assert torch.equal(again.values, policy.values)

    full = ActorRole.build(trainer_config(tiny_model_dir), world)
    with pytest.raises(ValueError, match=r"base-model log-probs need LoRA adapters"):
        full.compute_log_probs(batch, base_model=True)
    assert not trainer_config(
        tiny_model_dir, ["actor_rollout_ref.actor.use_kl_loss=true"]
    ).ref_in_actor


def test_one_layer_name_is_read_as_that_layer_not_a_whole_module_name(world, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir, [*LORA, "actor_rollout_ref.model.target_modules=q_proj"])
    trained = _trained_names(ActorRole.build(cfg, world).model)
    assert trained and all(".q_proj.lora_" in n for n in trained)


def test_gpt2_conv1d_layers_are_refused(tmp_path):
    # GPT-2 keeps its projections as Conv1D (weights stored transposed): W + s*B@A would be
    # merged the wrong way round.
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=22, n_positions=16)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"critic\.model\.target_modules.*c_attn \(Conv1D\)"):
        add_lora(model, ModelConfig(lora_rank=2, target_modules=["c_attn"]), key="critic.model")


def test_resuming_with_adapters_on_other_layers_is_refused(world, tiny_model_dir, tmp_path):
    actor = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    actor.save(str(tmp_path / "ckpt"), with_optimizer=False)
    other = [*LORA, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]
    fewer = ActorRole.build(trainer_config(tiny_model_dir, other), world)
    with pytest.raises(ValueError, match=r"other layers.*only in the checkpoint \['model\.layers"):
        fewer.load(str(tmp_path / "ckpt"), with_optimizer=False)
    other_alpha = [*LORA[:1], "actor_rollout_ref.model.lora_alpha=4"]
    with pytest.raises(ValueError, match="lora_alpha 8.*lora_alpha 4"):
        ActorRole.build(trainer_config(tiny_model_dir, other_alpha), world).load(
            str(tmp_path / "ckpt"), with_optimizer=False
        )


def test_a_checkpoint_of_another_model_is_refused_with_a_value_error(
    world, tiny_model_dir, tmp_path
):
    # torch's CheckpointException is a BaseException: unconverted, it passed every handler
    # and left the trainer's RPC unanswered until its deadline.
    full = ActorRole.build(trainer_config(tiny_model_dir), world)
    save_checkpoint(tmp_path / "ckpt", full.model, None, {})
    adapted = ActorRole.build(trainer_config(tiny_model_dir, LORA), world)
    with pytest.raises(ValueError, match="does not fit this role's model"):
        load_checkpoint(tmp_path / "ckpt", adapted.model, None)
