"""The memory plan's keys (docs/memory.md): verl's offload keys are the roles' own, and
compiled layers and recomputed activations follow the device unless set."""

import pytest

from meshrl.config import ConfigError, build_config


@pytest.mark.parametrize(
    ("verl", "ours"),
    [
        ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.param_offload"),
        ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor_rollout_ref.actor.optimizer_offload"),
        ("critic.model.fsdp_config.param_offload", "critic.param_offload"),
        ("critic.model.fsdp_config.optimizer_offload", "critic.optimizer_offload"),
    ],
)  # fmt: skip
def test_verls_offload_keys_set_the_roles_own(verl, ours):
    cfg = build_config({}, [f"{verl}=True"])
    section, key = ours.rsplit(".", 1)
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    assert getattr(node, key) is True
    with pytest.raises(ConfigError, match="different values"):
        build_config({}, [f"{verl}=true", f"{ours}=false"])


def test_compile_and_recompute_follow_the_device():
    cpu = build_config({}, [])
    gpu = build_config({}, ["trainer.device=cuda"])
    for cfg, on in ((cpu, False), (gpu, True)):
        arr = cfg.actor_rollout_ref
        assert arr.actor.use_torch_compile is on  # verl's default, true, on a GPU
        assert cfg.critic.use_torch_compile is on
        assert arr.ref.use_torch_compile is on
        assert arr.model.enable_gradient_checkpointing is on
        assert cfg.critic.model.enable_gradient_checkpointing is on


def test_given_settings_stay_and_the_reference_follows_the_actor():
    cfg = build_config(
        {},
        [
            "trainer.device=cuda",
            "actor_rollout_ref.actor.use_torch_compile=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        ],
    )
    assert cfg.actor_rollout_ref.actor.use_torch_compile is False
    assert cfg.actor_rollout_ref.ref.use_torch_compile is False  # verl's interpolation
    assert cfg.critic.use_torch_compile is True
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
    assert cfg.critic.model.enable_gradient_checkpointing is True


def test_the_environment_variable_is_gone():
    from pathlib import Path

    root = Path(__file__).parents[2]
    users = [
        p
        for folder in ("meshrl", "services", "benchmarks")
        for p in (root / folder).rglob("*.py")
        if "MESHRL_COMPILE_LAYERS" in p.read_text()
    ]
    assert users == []


def test_actor_and_critic_update_one_after_the_other_on_one_gpu():
    from meshrl.config.placement import updates_share_gpu

    assert updates_share_gpu(build_config({}, ["trainer.device=cuda"]))
    assert not updates_share_gpu(build_config({}, []))  # the CPU: in parallel, as before
    split = "launcher.role_gpus={actor: '0', critic: '1'}"
    assert not updates_share_gpu(build_config({}, ["trainer.device=cuda", split]))


def test_servers_load_one_after_the_other_only_when_offloading_on_a_shared_gpu():
    from meshrl.config.placement import loads_one_at_a_time

    offload = "critic.param_offload=true"
    assert loads_one_at_a_time(build_config({}, ["trainer.device=cuda", offload]))
    assert not loads_one_at_a_time(build_config({}, ["trainer.device=cuda"]))
    assert not loads_one_at_a_time(build_config({}, [offload]))  # the CPU: nothing shared
    split = "launcher.role_gpus={rollout: '1', actor: '0', critic: '0', ref: '0'}"
    assert not loads_one_at_a_time(build_config({}, ["trainer.device=cuda", offload, split]))
