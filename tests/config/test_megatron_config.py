"""strategy=megatron's config (meshrl/config/sections/megatron.py, meshrl/config/rules.py): sizes the role's ranks cannot be
split into, and what the Megatron backend does not run, are refused at start, one line each
naming the key."""

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
