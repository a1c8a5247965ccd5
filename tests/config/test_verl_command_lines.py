"""verl command lines as users paste them: single-string lists, Hydra's `+`/`++`/`~`
prefixes, "did you mean" for typos, and what to do instead for verl keys meshrl lacks."""

from pathlib import Path

import pytest

from meshrl.config import ConfigError, build_config, config_from_yaml, config_to_yaml, load_config
from meshrl_app import cli


def error_of(overrides: list[str], tree: dict | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(tree or {}, overrides)
    return str(err.value)


# --- one string where a list is meant ---------------------------------------------------


def test_a_single_path_or_logger_override_is_a_list_of_one():
    cfg = build_config(
        {},
        [
            "data.train_files=/root/data/gsm8k/train.parquet",
            "data.val_files=/root/data/gsm8k/test.parquet",
            "trainer.logger=console",
            "launcher.addresses.actor=127.0.0.1:5303",
        ],
    )
    assert cfg.data.train_files == ["/root/data/gsm8k/train.parquet"]
    assert cfg.data.val_files == ["/root/data/gsm8k/test.parquet"]
    assert cfg.trainer.logger == ["console"]
    assert cfg.launcher.addresses == {"actor": ["127.0.0.1:5303"]}
    assert config_from_yaml(config_to_yaml(cfg)) == cfg  # role servers get lists


def test_verls_quoted_list_overrides_still_read_as_lists():
    cfg = build_config(
        {}, ["data.train_files=['a.parquet','b.parquet']", 'trainer.logger=["console","wandb"]']
    )
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.logger == ["console", "wandb"]


def test_a_single_string_in_yaml_is_a_list_of_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  train_files: ~/data/gsm8k/train.parquet\n  val_files: test.parquet\n"
        "trainer:\n  logger: jsonl\n"
    )
    cfg = load_config(path)
    assert cfg.data.train_files == [str(Path.home() / "data/gsm8k/train.parquet")]  # ~ expanded
    assert cfg.data.val_files == ["test.parquet"] and cfg.trainer.logger == ["jsonl"]


@pytest.mark.parametrize(
    "tree, message",
    [
        (
            {"data": {"train_files": 5}},
            r"data\.train_files: Input should be a valid list \(got 5\)",
        ),
        ({"data": {"val_files": {"a": 1}}}, r"data\.val_files: Input should be a valid list"),
        ({"trainer": {"logger": "consol"}}, r"trainer\.logger\.0: Input should be 'console'"),
        ({"data": {"train_files": ""}}, r"data\.train_files: Input should be a valid list"),
    ],
    ids=["number", "mapping", "unknown logger", "empty"],
)
def test_other_wrong_types_are_still_refused(tree, message):
    with pytest.raises(ConfigError, match=message):
        build_config(tree)


# --- Hydra's prefixes ---------------------------------------------------------------------


def test_plus_and_double_plus_set_the_plain_key():
    cfg = build_config({}, ["+trainer.val_before_train=False", "++trainer.test_freq=5"])
    assert cfg.trainer.val_before_train is False and cfg.trainer.test_freq == 5


def test_an_unknown_key_after_a_plus_is_named_without_it():
    err = error_of(["+trainer.fooo=1"])
    assert "  trainer.fooo: unknown config key" in err and "+trainer" not in err


def test_a_plus_text_key_still_takes_the_value_as_typed():
    assert build_config({}, ["+trainer.experiment_name=0123"]).trainer.experiment_name == "0123"


def test_hydras_delete_is_refused_clearly():
    err = error_of(["~trainer.val_before_train"])
    assert "'~trainer.val_before_train': deleting a key (Hydra's ~) is not supported" in err


def test_bad_overrides_and_bad_keys_are_reported_in_one_message():
    err = error_of(
        ["~trainer.logger", "data.train_batch_size", "trainer.total_epoch=3", "data.seed=x"]
    )
    for expected in (
        "'~trainer.logger': deleting a key",
        "'data.train_batch_size' is not of the form key=value",
        "trainer.total_epoch: unknown config key",
        "data.seed: Input should be a valid integer",
    ):
        assert expected in err


# --- did you mean -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "actor_rollout_ref.actor.clip_ration=0.3",
            "actor_rollout_ref.actor.clip_ration: unknown config key; "
            "did you mean actor_rollout_ref.actor.clip_ratio?",
        ),
        (
            "actor_rollout_reff.actor.clip_ratio=0.3",  # reported at the unknown section
            "actor_rollout_reff: unknown config key; did you mean actor_rollout_ref?",
        ),
        (
            "trainer.total_epoch=3",
            "trainer.total_epoch: unknown config key; did you mean trainer.total_epochs?",
        ),
        (
            "launcher.resource_pool.big.gpu_per_node=8",  # below a pool the user named
            "launcher.resource_pool.big.gpu_per_node: unknown config key; "
            "did you mean launcher.resource_pool.big.gpus_per_node?",
        ),
    ],
    ids=lambda x: x.split("=")[0],
)
def test_a_typo_gets_the_closest_key_of_its_section(override, line):
    assert f"  {line}" in error_of([override])


def test_a_key_in_the_wrong_section_gets_where_it_lives():
    err = error_of(["trainer.lora_rank=8"])
    assert (
        "trainer.lora_rank: unknown config key; "
        "did you mean actor_rollout_ref.model.lora_rank or critic.model.lora_rank?"
    ) in err


def test_nothing_close_gets_no_suggestion():
    assert error_of(["trainer.zzz=1"]).endswith("trainer.zzz: unknown config key")


# --- verl keys meshrl does not have -------------------------------------------------------


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "trainer.critic_warmup=2",
            "trainer.critic_warmup: unknown config key (verl's): set critic.critic_warmup instead",
        ),
        (
            "trainer.n_gpus_per_node=8",
            "trainer.n_gpus_per_node: unknown config key (verl's), not used here: with "
            "trainer.device=cuda",
        ),
        ("trainer.nnodes=2", "trainer.nnodes: unknown config key (verl's), not used here"),
        (
            "trainer.max_actor_ckpt_to_keep=2",
            "trainer.max_actor_ckpt_to_keep: unknown config key (verl's): set "
            "trainer.max_ckpt_to_keep instead",
        ),
        (
            "trainer.max_critic_ckpt_to_keep=2",
            "trainer.max_critic_ckpt_to_keep: unknown config key (verl's): set "
            "trainer.max_ckpt_to_keep instead",
        ),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size: unknown config key (verl's), "
            "not used here",
        ),
        ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.mode: unknown"),
        (
            "actor_rollout_ref.model.trust_remote_code=True",
            "actor_rollout_ref.model.trust_remote_code: unknown config key (verl's), not used",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",  # its own key
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params: unknown config "
            "key (verl's), not used here: each trainer role is FSDP2-sharded",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.grad_offload=True",
            "actor_rollout_ref.actor.fsdp_config.grad_offload: unknown config key (verl's), not "
            "used here: each trainer role is FSDP2-sharded over its world_size ranks (or split by "
            "Megatron-Core with strategy=megatron, <role>.megatron.*); its weights and optimizer "
            "in CPU memory between calls: <role>.param_offload / "
            "optimizer_offload; only false, which asks for what meshrl does anyway, is accepted",
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",  # difflib alone: ppo_mini_...
            "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu instead",
        ),
    ],
    ids=lambda x: x.split("=")[0],
)
def test_a_verl_key_says_what_to_do_instead(override, line):
    assert line in error_of([override])


def test_verls_custom_reward_function_is_one_line_naming_our_format():
    err = error_of(["custom_reward_function.path=my.py", "custom_reward_function.name=fn"])
    lines = [line for line in err.splitlines() if "custom_reward_function" in line]
    assert lines == [
        "  custom_reward_function.path, custom_reward_function.name: unknown config key "
        "(verl's): set "
        "reward.custom_function=path/to/file.py:function_name instead (verl's path and name "
        "in one value; the name defaults to compute_score)"
    ]


def test_verls_reward_model_section_maps_each_setting():
    err = error_of(
        [
            "reward_model.enable=True",
            "reward_model.model.path=/models/rm",
            "+reward_model.overlong_buffer.len=512",
            "reward_model.reward_manager=dapo",
        ]
    )
    for expected in (
        "reward_model.enable: unknown config key (verl's): set reward.reward_model.enable",
        "reward_model.model.path: unknown config key (verl's): set reward.reward_model.path",
        "reward_model.overlong_buffer.len: unknown config key (verl's): set reward.overlong_buffer",
        "reward_model.reward_manager: unknown config key (verl's), not used here",
    ):
        assert expected in err
    # a setting of the section without an entry of its own gets the section's hint
    assert (
        "reward_model.strategy: unknown config key (verl's), not used here: the reward model is "
    ) in error_of(["reward_model.strategy=fsdp"])


def test_a_verl_grpo_command_line_exits_2_with_every_hint(tmp_path, capsys, monkeypatch):
    import meshrl_app.run_local as run_local

    def refuse(cfg, run_dir):
        raise AssertionError("role servers started for a config that cannot run")

    monkeypatch.setattr(run_local, "make_launcher", refuse)
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    argv = [
        "run",
        str(config),
        "algorithm.adv_estimator=grpo",
        "data.train_files=/root/data/gsm8k/train.parquet",
        "+trainer.val_before_train=False",
        "trainer.logger=console",
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.actor.clip_ration=0.2",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "trainer.n_gpus_per_node: unknown config key (verl's)" in err
    assert "did you mean actor_rollout_ref.actor.clip_ratio?" in err
    assert "train_files" not in err and "logger" not in err and "+trainer" not in err


def test_verls_resume_path_word_says_where_the_path_goes():
    """Before, `resume_path` was read as a checkpoint folder and failed, once the servers
    were up, as a folder that does not exist."""
    with pytest.raises(ConfigError) as e:
        build_config({}, ["trainer.resume_mode=resume_path"])
    assert "trainer.resume_mode=resume_path is verl's spelling: here resume_mode takes the " in (
        str(e.value)
    )


def test_verls_fsdp_fsdp2_and_megatron_strategies_run_as_pasted():
    """Before, verl's `strategy=fsdp` (its default) failed with "Input should be 'fsdp2'",
    and `critic.strategy` / `actor_rollout_ref.ref.strategy` were unknown keys. fsdp and
    fsdp2 both run as FSDP2 here; megatron as Megatron-Core (docs/megatron.md), with verl's
    `megatron.tensor_model_parallel_size` and `pipeline_model_parallel_size` keys."""
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.actor.strategy=fsdp",
            "actor_rollout_ref.ref.strategy=fsdp",
            "critic.strategy=fsdp2",
        ],
    )
    assert (cfg.actor_rollout_ref.actor.strategy, cfg.critic.strategy) == ("fsdp", "fsdp2")
    assert config_from_yaml(config_to_yaml(cfg)) == cfg  # what the role servers get
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
            "actor_rollout_ref.ref.strategy=megatron",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
            "critic.strategy=megatron",
            "critic.megatron.pipeline_model_parallel_size=1",
        ],
    )
    assert (cfg.actor_rollout_ref.ref.strategy, cfg.critic.strategy) == ("megatron", "megatron")
    assert config_from_yaml(config_to_yaml(cfg)) == cfg
    assert "Input should be 'fsdp', 'fsdp2' or 'megatron' (got 'ddp')" in error_of(
        ["actor_rollout_ref.actor.strategy=ddp"]
    )


# verl's GSM8k PPO quick start (its docs), as pasted, paths aside
VERL_QUICK_START = """
data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet
data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=512
actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
critic.model.path=Qwen/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False
trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10
trainer.total_epochs=15
""".split()


def test_verls_quick_start_line_runs_as_pasted():
    """Before, three keys of it failed: tensor_model_parallel_size=1, n_gpus_per_node=1 and
    nnodes=1 ask for what meshrl does anyway (one device a rollout server, the roles on one
    node and GPU), so those values are accepted; others are still refused with the hint."""
    cfg = build_config({}, VERL_QUICK_START)
    assert cfg.data.train_files == ["/data/gsm8k/train.parquet"]
    # n_gpus_per_node=1 asks for one GPU: verl's default device, here made explicit (before,
    # the line trained on meshrl's default, the CPU), and with it verl's bf16 compute
    assert cfg.trainer.device == "cuda" and cfg.actor_rollout_ref.model.dtype == "bfloat16"
    on_cpu = build_config({}, [*VERL_QUICK_START, "trainer.device=cpu"])
    assert on_cpu.trainer.device == "cpu"  # a device given is kept
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4
    assert cfg.trainer.total_epochs == 15 and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert "nnodes" not in config_to_yaml(cfg)  # nothing of them reaches the role servers
    message = error_of([*VERL_QUICK_START, "trainer.n_gpus_per_node=8", "trainer.nnodes=true"])
    assert "trainer.n_gpus_per_node: unknown config key (verl's), not used here" in message
    assert "only 1, which asks for what meshrl does anyway, is accepted" in message
    assert "trainer.nnodes: unknown config key" in message  # true is no 1
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    assert f"{tp}: unknown config key" in error_of([f"{tp}=2"])
    yaml_tree = {"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 1}}}
    assert build_config(yaml_tree, []) == build_config({}, [])  # in a YAML file too


# verl's GRPO example for GSM8k (examples/grpo_trainer), as pasted, paths aside
VERL_GRPO_EXAMPLE = """
algorithm.adv_estimator=grpo data.train_files=/data/gsm8k/train.parquet
data.val_files=/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_7b_function_rm
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
trainer.total_epochs=15
""".split()


def test_verls_grpo_example_is_refused_only_where_it_asks_for_something_else():
    """Its no-offload, critic_warmup=0 and nnodes=1 settings ask for what meshrl does and
    pass, and its reference offloaded to the CPU is actor_rollout_ref.ref.param_offload;
    what is left is what meshrl would do otherwise: two GPUs for one rollout server, eight
    GPUs a node placed by verl. Before, six keys, then three."""
    message = error_of(VERL_GRPO_EXAMPLE)
    refused = [line.split(":")[0].strip() for line in message.splitlines()[1:]]
    assert refused == [
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "trainer.n_gpus_per_node",
    ]
    edited = [o for o in VERL_GRPO_EXAMPLE if not o.startswith(tuple(refused))]
    cfg = build_config({}, edited)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.critic.critic_warmup == 0 and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.actor_rollout_ref.ref.param_offload


# Three more of verl's examples (GRPO on Qwen3-0.6B, PPO with sequence balancing, GRPO with
# LoRA merged), as pasted, paths aside; then what each is refused for.
VERL_MORE_EXAMPLES = {
    "grpo_qwen3_0.6b_fsdp": (
        """
algorithm.adv_estimator=grpo data.train_files=/d/gsm8k/train.parquet
data.val_files=/d/gsm8k/test.parquet data.train_batch_size=64 data.max_prompt_length=512
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
actor_rollout_ref.model.path=/m/Qwen3-0.6B actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger=["console"] trainer.project_name=p trainer.experiment_name=e
trainer.n_gpus_per_node=4 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
+actor_rollout_ref.rollout.enable_sleep_mode=False actor_rollout_ref.rollout.free_cache_engine=False
trainer.total_epochs=15
""",
        ["trainer.n_gpus_per_node"],
    ),
    "ppo_qwen2-7b_seq_balance": (
        """
algorithm.adv_estimator=gae data.train_files=['/d/gsm8k/train.parquet','/d/math/train.parquet']
data.val_files=['/d/gsm8k/test.parquet','/d/math/test.parquet'] data.return_raw_chat=True
data.train_batch_size=4096 data.max_prompt_length=4096 data.max_response_length=4096
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=/m/Qwen2-7B
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.ppo_mini_batch_size=512 actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.multi_turn.format=hermes actor_rollout_ref.rollout.gpu_memory_utilization=0.5
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24000 critic.optim.lr=1e-5
critic.model.use_remove_padding=True critic.model.path=/m/Qwen2-7B
critic.model.enable_gradient_checkpointing=True critic.ppo_max_token_len_per_gpu=98304
critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=p trainer.experiment_name=e trainer.n_gpus_per_node=8
trainer.val_before_train=False trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
trainer.total_epochs=15
""",
        ["actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.n_gpus_per_node"],
    ),
    "grpo_qwen3-4b_lora_merge": (
        """
algorithm.adv_estimator=grpo trainer.val_before_train=True data.train_files=/d/gsm8k/train.parquet
data.val_files=/d/gsm8k/test.parquet data.train_batch_size=128 data.max_prompt_length=1024
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
data.shuffle=False actor_rollout_ref.model.path=/m/Qwen3-4B
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.enable_gradient_checkpointing=True
+actor_rollout_ref.model.lora.merge=True actor_rollout_ref.model.lora_rank=32
actor_rollout_ref.model.lora_alpha=64 actor_rollout_ref.actor.optim.lr=1.0e-05
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.strategy=fsdp2
actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=8
actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.ref.strategy=fsdp2
actor_rollout_ref.ref.fsdp_config.model_dtype=bf16 algorithm.use_kl_in_reward=False
trainer.use_legacy_worker_impl=disable trainer.critic_warmup=0
trainer.logger=["console","tensorboard","file"] trainer.project_name=p trainer.experiment_name=e
trainer.default_local_dir=outputs/p/e/ trainer.n_gpus_per_node=8 trainer.nnodes=1
trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=1
""",
        [
            "actor_rollout_ref.actor.fsdp_config.model_dtype",
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "actor_rollout_ref.ref.fsdp_config.model_dtype",
            "trainer.n_gpus_per_node",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(VERL_MORE_EXAMPLES))
def test_more_of_verls_examples_are_refused_only_where_they_ask_for_something_else(name):
    """Before, these were also refused for knobs of verl's own machinery (data loader
    workers, `load_format`, `layered_summon`, `use_legacy_worker_impl`, the multi-turn
    tool format), for `return_raw_chat`, `lora.merge=True`, `enable_sleep_mode=False` beside
    `free_cache_engine=False`, and verl's `file` logger; `model_dtype` errors named only
    `fsdp_config`. What is left asks for what meshrl does otherwise (sharded rollout, an
    offloaded reference, several GPUs placed by verl, a dtype under another key)."""
    text, refused = VERL_MORE_EXAMPLES[name]
    overrides = text.split()
    lines = error_of(overrides).splitlines()[1:]
    assert [line.split(": unknown config key")[0].strip() for line in lines] == refused
    edited = [o for o in overrides if not o.startswith(tuple(refused))]
    cfg = build_config({}, edited)
    assert config_from_yaml(config_to_yaml(cfg)) == cfg
    if name == "grpo_qwen3-4b_lora_merge":
        assert cfg.trainer.logger == ["console", "tensorboard", "jsonl"]  # verl's file logger
        assert cfg.actor_rollout_ref.model.lora_rank == 32
    if name == "grpo_qwen3_0.6b_fsdp":
        assert cfg.actor_rollout_ref.rollout.free_cache_engine is False
        assert cfg.actor_rollout_ref.ref.param_offload  # verl's ref.fsdp_config.param_offload


def test_a_path_given_from_the_home_folder_is_expanded():
    """A shell leaves `key=~/x` as typed (the word does not start with ~): before, the data
    and the model were looked for in a folder named `~`."""
    home = Path.home()
    cfg = build_config(
        {},
        [
            "data.train_files=~/data/gsm8k/train.parquet",
            "actor_rollout_ref.model.path=~/models/Qwen2.5-0.5B",
            "trainer.default_local_dir=~/runs/a",
            "reward.custom_function=~/rewards.py:score",
        ],
    )
    assert cfg.data.train_files == [str(home / "data/gsm8k/train.parquet")]
    assert cfg.actor_rollout_ref.model.path == str(home / "models/Qwen2.5-0.5B")
    assert cfg.trainer.default_local_dir == str(home / "runs/a")
    assert cfg.reward.custom_function == str(home / "rewards.py") + ":score"
    assert build_config({}, ["trainer.experiment_name=~x"]).trainer.experiment_name == "~x"


def test_verls_short_dtype_names_and_warmup_default_read_as_they_mean():
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.model.dtype=bf16",
            "actor_rollout_ref.rollout.dtype=fp16",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",  # verl: take the ratio, 0
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0",
        ],
    )
    assert cfg.actor_rollout_ref.model.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.rollout.dtype == "float16"
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps == 0
    assert "lr_warmup_steps_ratio: unknown config key" in error_of(
        ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"]
    )
    assert "lr_warmup_steps: Input should be greater than or equal to 0" in error_of(
        ["actor_rollout_ref.actor.optim.lr_warmup_steps=-2"]
    )


# --- verl's command line shape: no config file --------------------------------------------


def test_meshrl_run_takes_overrides_alone_as_verls_command_lines_give_them(
    monkeypatch, tmp_path, capsys
):
    """Before, the first override was read as the config file's name: `config file
    data.train_files=... does not exist`."""
    import meshrl_app.run_local as run_local_module
    from meshrl_app.run_local import RunResult

    ran = []
    monkeypatch.setattr(
        run_local_module, "run_local", lambda cfg, *_: ran.append(cfg) or RunResult({}, True)
    )
    monkeypatch.chdir(tmp_path)
    line = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m"]
    assert cli.main(["run", *line, "trainer.total_epochs=2"]) == 0
    assert ran[-1].data.train_files == ["/d/train.parquet"] and ran[-1].trainer.total_epochs == 2
    assert cli.config_and_overrides("a=b", ["c=d"]) == (None, ["a=b", "c=d"])
    assert cli.config_and_overrides("run.yaml", ["c=d"]) == ("run.yaml", ["c=d"])
    (tmp_path / "odd=name.yaml").write_text("trainer: {total_epochs: 3}\n")
    assert cli.config_and_overrides("odd=name.yaml", []) == ("odd=name.yaml", [])  # a file wins
    # nothing at all: the keys every run needs, named together, before anything starts
    monkeypatch.undo()
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files is empty" in err and "actor_rollout_ref.model.path is empty" in err
