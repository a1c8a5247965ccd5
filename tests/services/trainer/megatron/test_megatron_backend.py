"""The Megatron-Core backend against the FSDP2 backend on the CPU (float32, one gloo rank):
on the same weights and batch, the same log-probs, entropies, values, PPO losses, gradient
norms, updated weights, and the same Hugging Face names and tensors for weight sync. Both
run the roles' one loss assembly (meshrl/algorithms); only the model differs."""

import pytest
import torch
from trainer_helpers import make_batch, trainer_config
from transformers import AutoModelForCausalLM, LlamaConfig

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir, make_tiny_qwen2_dir
from services.trainer.actor import ActorRole
from services.trainer.critic import CriticRole
from services.trainer.reference import RefRole

pytest.importorskip("megatron.core")

MEGATRON = "actor_rollout_ref.actor.strategy=megatron"


def _randomised(path):
    """Every weight drawn at random (Qwen2's q/k/v biases start at zero: a misplaced bias
    row would go unseen), written back to the folder."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_bias_tied"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_bias_tied":  # 4 query heads over 2 KV heads, tied embeddings
        return _randomised(make_tiny_qwen2_dir(path, hidden=64, layers=2))
    make_tiny_model_dir(path, hidden=64, layers=2, heads=4)
    config = LlamaConfig.from_pretrained(path)
    config.num_key_value_heads = 2  # grouped-query attention
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return _randomised(path)


def _advantages(logprobs: Ragged) -> Ragged:
    g = torch.Generator().manual_seed(0)
    return Ragged(torch.randn(logprobs.values.shape, generator=g), logprobs.offsets)


def test_the_actor_scores_and_updates_as_the_fsdp2_actor(model_dir, world):
    batch = make_batch(8, seed=1)
    results = {}
    for strategy in ("fsdp2", "megatron"):
        cfg = trainer_config(model_dir, [f"actor_rollout_ref.actor.strategy={strategy}"])
        actor = ActorRole.build(cfg, world)
        logprobs, entropy = actor.compute_log_probs(batch, with_entropy=True)
        metrics = actor.update_policy(batch, logprobs, _advantages(logprobs), None, None, 1)
        after, _ = actor.compute_log_probs(batch)
        results[strategy] = (logprobs, entropy, metrics, after, dict(actor.iter_full_params()),
                             actor.named_param_shapes(), actor.num_parameters)  # fmt: skip
    (lp_f, ent_f, m_f, after_f, w_f, shapes_f, n_f) = results["fsdp2"]
    (lp_m, ent_m, m_m, after_m, w_m, shapes_m, n_m) = results["megatron"]
    assert type(ActorRole.build(trainer_config(model_dir, [MEGATRON]), world).model).__name__ == (
        "MegatronLM"
    )
    torch.testing.assert_close(lp_m.values, lp_f.values, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_m.values, ent_f.values, rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert m_m[key] == pytest.approx(m_f[key], rel=1e-5, abs=1e-6), key
    assert m_f["actor/grad_norm"] > 0.1  # a real step: the weights moved
    torch.testing.assert_close(after_m.values, after_f.values, rtol=0, atol=1e-5)
    # weight sync: the same Hugging Face names, shapes and (updated) tensors
    assert dict(shapes_m) == dict(shapes_f) and n_m == n_f
    assert sorted(w_m) == sorted(w_f)
    for name, tensor in w_f.items():
        torch.testing.assert_close(w_m[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_the_reference_and_the_critic_equal_the_fsdp2_ones(model_dir, world):
    batch = make_batch(6, seed=2)
    out = {}
    for strategy in ("fsdp2", "megatron"):
        cfg = trainer_config(model_dir, [f"actor_rollout_ref.ref.strategy={strategy}",
                                         f"critic.strategy={strategy}"])  # fmt: skip
        ref_lp, _ = RefRole.build(cfg, world).compute_log_probs(batch)
        critic = CriticRole.build(cfg, world)
        values = critic.compute_values(batch)  # the fresh head: all zero
        g = torch.Generator().manual_seed(4)
        returns = Ragged(torch.randn(values.values.shape, generator=g), values.offsets)
        metrics = critic.update_value(batch, values, returns, 1)
        critic.update_value(batch, values, returns, 2)
        out[strategy] = (ref_lp, critic.compute_values(batch), metrics)
    (ref_f, v_f, m_f), (ref_m, v_m, m_m) = out["fsdp2"], out["megatron"]
    torch.testing.assert_close(ref_m.values, ref_f.values, rtol=0, atol=1e-5)
    assert v_f.values.abs().max() > 1e-3  # two steps moved the head and the decoder
    torch.testing.assert_close(v_m.values, v_f.values, rtol=0, atol=1e-5)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert m_m[key] == pytest.approx(m_f[key], rel=1e-5), key


def test_a_checkpoint_resumes_the_same_weights_and_moments_and_exports_hf_names(
    model_dir, world, tmp_path
):
    batch = make_batch(8, seed=1)
    cfg = trainer_config(model_dir, [MEGATRON])
    actor = ActorRole.build(cfg, world)
    lp, _ = actor.compute_log_probs(batch)
    actor.update_policy(batch, lp, _advantages(lp), None, None, 1)
    actor.save(str(tmp_path / "actor"), with_optimizer=True)
    saved = {n: t.clone() for n, t in actor.iter_full_params()}
    next_metrics = actor.update_policy(batch, lp, _advantages(lp), None, None, 2)

    restored = ActorRole.build(cfg, world)
    restored.load(str(tmp_path / "actor"), with_optimizer=True)
    assert restored.update_count == 1
    for name, tensor in restored.iter_full_params():
        assert torch.equal(tensor, saved[name]), name
    # the moments came back too: the next update is the one the first actor made
    again = restored.update_policy(batch, lp, _advantages(lp), None, None, 2)
    assert again["actor/grad_norm"] == pytest.approx(next_metrics["actor/grad_norm"], rel=1e-6)
    assert again["actor/pg_loss"] == pytest.approx(next_metrics["actor/pg_loss"], rel=1e-6)

    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp_path / "actor")).read_metadata().state_dict_metadata)
    assert {f"model.{n}" for n in saved} <= keys  # what `meshrl export` reads

    fsdp_actor = ActorRole.build(trainer_config(model_dir), world)
    with pytest.raises(ValueError, match="saved by the megatron trainer backend"):
        fsdp_actor.load(str(tmp_path / "actor"), with_optimizer=True)


def test_bf16_log_probs_stay_within_bf16_of_float32(model_dir, world):
    """bf16 compute over float32 masters (autocast), on the CPU too."""
    batch = make_batch(6, seed=5)
    fp32 = ActorRole.build(trainer_config(model_dir, [MEGATRON]), world)
    bf16 = ActorRole.build(
        trainer_config(model_dir, [MEGATRON, "actor_rollout_ref.model.dtype=bfloat16"]), world
    )
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # the masters
    exact, _ = fp32.compute_log_probs(batch)
    low, _ = bf16.compute_log_probs(batch)
    diff = (low.values - exact.values).abs()
    assert 0 < diff.max() < 0.1


def test_recomputed_layers_train_as_stored_activations(model_dir, world):
    """enable_gradient_checkpointing: each layer recomputed in backward (torch's
    non-reentrant checkpoint), the same update bit for bit in float32."""
    batch = make_batch(8, seed=1)
    metrics = []
    for recompute in ("false", "true"):
        over = [MEGATRON, f"actor_rollout_ref.model.enable_gradient_checkpointing={recompute}"]
        actor = ActorRole.build(trainer_config(model_dir, over), world)
        lp, _ = actor.compute_log_probs(batch)
        metrics.append(actor.update_policy(batch, lp, _advantages(lp), None, None, 1))
    assert metrics[1]["actor/grad_norm"] == metrics[0]["actor/grad_norm"]
    assert metrics[1]["actor/pg_loss"] == metrics[0]["actor/pg_loss"]


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused_naming_the_key(
    model_dir, world
):
    """The trainer's own refusal (a role server started without a run's preflight), before
    any Megatron group is made."""
    key = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
    cfg = trainer_config(model_dir, [MEGATRON, "actor_rollout_ref.actor.world_size=3", f"{key}=3"])
    with pytest.raises(
        ValueError, match=rf"^{key}=3 does not divide the model's 4 attention heads"
    ):
        ActorRole.build(cfg, world)
