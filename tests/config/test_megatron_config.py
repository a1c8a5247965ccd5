"""strategy=megatron's config (meshrl/config/sections/megatron.py, meshrl/config/rules.py): sizes the role's ranks cannot be
split into, and what the Megatron backend does not run, are refused at start, one line each
naming the key."""

import json

import pytest
from test_verl_command_lines import error_of

from meshrl.config import build_config

MEGATRON = ["actor_rollout_ref.actor.strategy=megatron"]


def test_sizes_that_do_not_divide_the_role_s_ranks_are_refused_naming_the_key():
    message = error_of(
        [
            *MEGATRON,
            "actor_rollout_ref.actor.world_size=3",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        ]
    )
    assert (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 x "
        "pipeline_model_parallel_size=1 does not divide actor_rollout_ref.actor.world_size=3"
    ) in message
    line = next(ln for ln in message.splitlines() if "does not divide" in ln)
    assert line.strip().startswith("actor_rollout_ref.actor.megatron")  # one line, the key first


def test_sizes_that_divide_but_are_not_run_yet_say_so():
    message = error_of(
        [
            "critic.strategy=megatron",
            "critic.world_size=4",
            "critic.megatron.pipeline_model_parallel_size=2",
        ]
    )
    assert "does not divide" not in message
    assert (
        "critic.megatron.pipeline_model_parallel_size=2: meshrl's Megatron backend runs only 1 yet"
        in message
    )


def test_the_sizes_are_checked_only_for_a_megatron_role():
    cfg = build_config({}, ["critic.megatron.tensor_model_parallel_size=2"])  # critic is fsdp2
    assert cfg.critic.megatron.tensor_model_parallel_size == 2


def test_lora_and_padding_free_rows_are_refused_with_megatron():
    message = error_of(
        [
            *MEGATRON,
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.use_remove_padding=true",
        ]
    )
    assert (
        "actor_rollout_ref.model.lora_rank=8 does not go with actor_rollout_ref.actor.strategy=megatron"
        in message
    )
    assert "actor_rollout_ref.model.use_remove_padding=true does not go with" in message


def test_verls_other_megatron_keys_are_accepted_only_with_what_runs():
    assert build_config({}, [*MEGATRON, "actor_rollout_ref.actor.megatron.context_parallel_size=1"])
    assert "context_parallel_size" in error_of(
        [*MEGATRON, "actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    )
    assert "sequence_parallel" in error_of(
        [*MEGATRON, "actor_rollout_ref.actor.megatron.sequence_parallel=true"]
    )


def test_tensor_parallel_sizes_that_divide_the_role_s_ranks_run():
    for world_size in (2, 4):  # tp 2 alone, tp 2 x dp 2
        cfg = build_config({}, [*MEGATRON, f"actor_rollout_ref.actor.world_size={world_size}",
                                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])  # fmt: skip
        assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2


def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused_naming_the_key(
    tmp_path,
):
    """At a run's start (preflight reads the model folder's config.json), one line a count."""
    from meshrl.config.errors import ConfigError
    from services.coordinator.run.preflight import check_megatron_splits

    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 22})
    )
    key = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
    cfg = build_config({}, [*MEGATRON, f"actor_rollout_ref.model.path={tmp_path}",
                            "actor_rollout_ref.actor.world_size=4", f"{key}=4"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_megatron_splits(cfg)
    where = tmp_path / "config.json"
    assert str(e.value).splitlines()[1:] == [
        f"  {key}=4 does not divide the model's 6 attention heads (num_attention_heads of {where})",
        f"  {key}=4 does not divide the model's 2 KV heads (num_key_value_heads of {where})",
        f"  {key}=4 does not divide the model's 22 vocabulary entries (vocab_size of {where})",
    ]
    ok = build_config({}, [*MEGATRON, f"actor_rollout_ref.model.path={tmp_path}",
                           "actor_rollout_ref.actor.world_size=2", f"{key}=2"])  # fmt: skip
    check_megatron_splits(ok)  # 6 heads, 2 KV heads, 22 entries: all split in two
