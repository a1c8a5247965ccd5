"""The memory plan (meshrl/config/memory_plan.py, docs/memory.md): each role's estimate per
phase from the model's shape, summed per GPU, and a plan that cannot fit refused before any
server starts, in one line that names the roles, their estimates, the device and what to
change."""

import json

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.config.memory_plan import (
    GIB,
    ModelShape,
    check_plan_fits,
    plan_gpus,
    role_memory,
    vllm_memory_fraction,
)
from services.coordinator.run.preflight import check_gpu_memory

# Qwen2.5-0.5B's and Qwen2.5-7B's config.json (the fields the plan reads)
QWEN05 = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
QWEN7B = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
H100 = int(79.2 * GIB)
# The whole-step benchmark's batch (benchmarks/ppo/step.py): 256 prompts, 512 + 512 tokens.
STEP = [
    "trainer.device=cuda",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "data.train_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "critic.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.max_num_seqs=256",
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
]
OFFLOAD = [
    "actor_rollout_ref.actor.param_offload=true",
    "actor_rollout_ref.actor.optimizer_offload=true",
    "critic.param_offload=true",
    "critic.optimizer_offload=true",
]


def test_parameter_counts_are_the_published_ones():
    assert ModelShape.from_config(QWEN05).params == 494_032_768  # Qwen2.5-0.5B
    assert ModelShape.from_config(QWEN7B).params == 7_615_616_512  # Qwen2.5-7B


def test_a_kv_cache_position_by_hand():
    # K and V, 24 layers, 2 KV heads of 64, 2 bytes: 12 KiB a position
    assert ModelShape.from_config(QWEN05).kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2


def test_the_trainers_state_by_hand():
    cfg = build_config({}, STEP)
    shape = ModelShape.from_config(QWEN05)
    actor = next(r for r in role_memory(cfg, shape, H100) if r.role == "actor")
    n = shape.params
    assert actor.parts["float32 weights"] == 4 * n
    assert actor.parts["optimizer moments"] == 8 * n  # AdamW's two moments
    assert actor.parts["gradients"] == 4 * n + 4 * n  # and one unit's float32 reduction buffer
    assert actor.parts["compute-dtype copy"] == 2 * n  # bf16, one rank: the whole model
    # between calls: CUDA context + masters + moments, with the allocator's slack
    assert actor.phases["generate"] == pytest.approx(GIB + 1.25 * 12 * n, abs=1)


def test_recomputed_activations_are_a_fraction():
    shape = ModelShape.from_config(QWEN05)
    kept = shape.activation_bytes(16384, 2, checkpointing=False)
    recomputed = shape.activation_bytes(16384, 2, checkpointing=True)
    # 24 layers of ~47 KB a token against each layer's input (1.75 KB) plus one layer
    assert kept == pytest.approx(24 * 2 * (10 * 896 + 3 * 4864) * 16384)
    assert recomputed < kept / 10


def test_the_default_half_billion_step_fits_a_40_gib_card():
    """The issue's bar: the 0.5B default on one GPU at most 40 GiB, fast engine or vLLM."""
    shape = ModelShape.from_config(QWEN05)
    for engine in ("fast", "vllm"):
        cfg = build_config({}, [*STEP, f"actor_rollout_ref.rollout.name={engine}"])
        (plan,) = plan_gpus(cfg, shape, H100)
        assert plan.peak < 40 * GIB, plan.describe()
        assert {r.role for r in plan.roles} == {"rollout", "actor", "critic", "ref"}


def test_offload_frees_the_trainers_memory_while_rollout_generates():
    shape = ModelShape.from_config(QWEN05)
    (resident,) = plan_gpus(build_config({}, STEP), shape, H100)
    (offloaded,) = plan_gpus(build_config({}, [*STEP, *OFFLOAD]), shape, H100)
    saved = resident.total("generate") - offloaded.total("generate")
    # float32 masters (4 bytes) and moments (8) of the actor and of the critic's value model
    assert saved == pytest.approx(1.25 * (12 * shape.params + 12 * shape.value_params), abs=2)
    # ... while each update still needs its own state on the GPU
    assert offloaded.total("update_actor") > 12 * shape.params


def test_vllm_is_given_what_the_batch_needs_not_its_whole_share():
    shape = ModelShape.from_config(QWEN05)
    cfg = build_config({}, [*STEP, "actor_rollout_ref.rollout.name=vllm"])
    share = vllm_memory_fraction(shape, cfg, H100)
    # weights 1 GB + 256 x 1024 positions x 12 KiB (3 GiB) + 4 GiB workspace, of 79.2 GiB
    assert share == pytest.approx(
        (2 * shape.params + 256 * 1024 * 12288 + 4 * GIB) / H100, abs=0.01
    )
    assert share < cfg.actor_rollout_ref.rollout.gpu_memory_utilization


def test_a_plan_that_cannot_fit_is_refused_in_one_line_naming_roles_sizes_and_fixes():
    shape = ModelShape.from_config(QWEN7B)
    cfg = build_config({}, STEP)
    with pytest.raises(ValueError) as refused:
        check_plan_fits(cfg, shape, H100)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("the roles on GPU 0 need about ")
    for part in ("actor", "critic", "ref", "rollout", "more than the 79.2 GiB it has"):
        assert part in line
    for key in ("actor_rollout_ref.actor.param_offload=true", "critic.optimizer_offload=true"):
        assert key in line


def test_roles_on_other_gpus_are_summed_apart():
    shape = ModelShape.from_config(QWEN05)
    split = "launcher.role_gpus={rollout: '1', actor: '0', critic: '0', ref: '0'}"
    plans = plan_gpus(build_config({}, [*STEP, split]), shape, H100)
    assert [(p.gpu, sorted(r.role for r in p.roles)) for p in plans] == [
        ("0", ["actor", "critic", "ref"]),
        ("1", ["rollout"]),
    ]


def _model_folder(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_run_is_refused_before_any_server_starts(tmp_path):
    said = []
    model = _model_folder(tmp_path, QWEN7B)
    cfg = build_config(
        {}, [*STEP, f"actor_rollout_ref.model.path={model}", "launcher.gpu_memory_gib=79.2"]
    )
    with pytest.raises(ConfigError, match="the roles on GPU 0 need about"):
        check_gpu_memory(cfg, said.append)
    assert said == []


def test_a_plan_that_fits_is_said_and_the_check_can_be_skipped(tmp_path):
    said = []
    model = _model_folder(tmp_path, QWEN05)
    given = [*STEP, f"actor_rollout_ref.model.path={model}", "launcher.gpu_memory_gib=79.2"]
    check_gpu_memory(build_config({}, given), said.append)
    assert len(said) == 1 and said[0].startswith("GPU memory estimate, GPU 0: ")
    big = _model_folder(tmp_path, QWEN7B)
    skipped = [*given, f"actor_rollout_ref.model.path={big}", "launcher.check_gpu_memory=false"]
    check_gpu_memory(build_config({}, skipped), said.append)  # no error
    cpu = [*given[1:], f"actor_rollout_ref.model.path={big}"]  # trainer.device=cpu: no GPU
    check_gpu_memory(build_config({}, cpu), said.append)
    assert len(said) == 1
