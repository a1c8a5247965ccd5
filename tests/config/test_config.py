import pytest

from meshrl.config import (
    ConfigError,
    build_config,
    config_from_yaml,
    config_to_yaml,
    load_config,
    rules,
)


def test_defaults_follow_verl_names():
    cfg = build_config()
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.data.train_batch_size == 256
    assert cfg.use_critic  # gae needs a critic


def test_dotted_overrides_parse_yaml_values():
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "data.train_files=[a.parquet,b.parquet]",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.use_ref


def test_unknown_key_is_named():
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref\.actor\.clip_ration: unknown config key"
    ):
        build_config({}, ["actor_rollout_ref.actor.clip_ration=0.3"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size: .*integer"):
        build_config({}, ["data.train_batch_size=lots"])


def test_bad_choice_is_named():
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator"):
        build_config({}, ["algorithm.adv_estimator=ppo2"])


def test_override_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        build_config({}, ["data.train_batch_size"])


def test_mini_batch_larger_than_batch_fails():
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        build_config(
            {}, ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
        )


def test_critic_mini_batch_follows_the_actor_and_is_checked_when_the_critic_runs():
    small = ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    assert build_config({}, small).critic.ppo_mini_batch_size == 16  # unset: the actor's
    with pytest.raises(ConfigError, match=r"critic\.ppo_mini_batch_size \(64\) exceeds"):
        build_config({}, [*small, "critic.ppo_mini_batch_size=64"])  # gae: the critic runs
    with pytest.raises(ConfigError, match=r"multiple of critic\.ppo_mini_batch_size \(12\)"):
        build_config({}, [*small, "critic.ppo_mini_batch_size=12"])
    build_config({}, [*small, "critic.ppo_mini_batch_size=64", "algorithm.adv_estimator=grpo"])


def test_interpolation_and_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  experiment_name: exp1\n")
    cfg = load_config(path, ["trainer.project_name=p"])
    assert cfg.trainer.default_local_dir == "runs/p/exp1"
    assert config_from_yaml(config_to_yaml(cfg)) == cfg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_weight_sync_buckets_default_by_device():
    # measured: on CPU, buckets smaller than a weight matrix sync at 1.28x a raw broadcast,
    # 256 MB ones at 2.0x (docs/benchmarks.md); GPUs keep large buckets
    cpu = build_config({}, [])
    gpu = build_config({}, ["trainer.device=cuda"])
    sync = cpu.actor_rollout_ref.rollout.weight_sync
    assert sync.bucket_bytes(cpu.trainer.device) == 4 * 2**20
    assert gpu.actor_rollout_ref.rollout.weight_sync.bucket_bytes(gpu.trainer.device) == 256 * 2**20
    chosen = build_config({}, ["actor_rollout_ref.rollout.weight_sync.bucket_size_mb=32"])
    assert chosen.actor_rollout_ref.rollout.weight_sync.bucket_bytes("cpu") == 32 * 2**20


def test_critic_compute_dtype_follows_the_actors_unless_set():
    from services.trainer.critic import compute_dtype

    assert compute_dtype(build_config({}, [])) == "float32"  # on the CPU, the default
    assert compute_dtype(build_config({}, ["trainer.device=cuda"])) == "bfloat16"  # as verl
    assert compute_dtype(build_config({}, ["actor_rollout_ref.model.dtype=bfloat16"])) == "bfloat16"
    both = ["actor_rollout_ref.model.dtype=bfloat16", "critic.model.dtype=float32"]
    assert compute_dtype(build_config({}, both)) == "float32"


def test_kl_estimators_are_checked_at_start():
    # Unchecked, a typo failed only in the first step's advantages or actor update.
    for key in ("algorithm.kl_penalty", "actor_rollout_ref.actor.kl_loss_type"):
        with pytest.raises(ConfigError, match=rf"{key}: Input should be 'kl'"):
            build_config({}, [f"{key}=low_var"])
    cfg = build_config({}, ["algorithm.kl_penalty=k3+", "actor_rollout_ref.actor.kl_loss_type=mse"])
    assert cfg.algorithm.kl_penalty == "k3+"


def test_config_kl_estimators_are_the_algorithms():
    import typing

    from meshrl.algorithms.kl import KL_ESTIMATOR_KINDS
    from meshrl.config.sections import KLEstimator

    assert set(typing.get_args(KLEstimator)) == set(KL_ESTIMATOR_KINDS)


def test_max_ckpt_to_keep_is_a_count_or_all():
    # -1 made prune() remove the checkpoint just written (complete()[:1] when it is alone)
    with pytest.raises(ConfigError, match=r"trainer\.max_ckpt_to_keep"):
        build_config({}, ["trainer.max_ckpt_to_keep=-1"])
    assert build_config({}, ["trainer.max_ckpt_to_keep=0"]).trainer.max_ckpt_to_keep == 0  # all


@pytest.mark.parametrize(
    "override", ["n=0", "temperature=-0.5", "top_p=0", "top_p=1.5"], ids=lambda o: o
)
def test_validation_sampling_values_are_checked(override):
    key = "actor_rollout_ref.rollout.val_kwargs." + override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config({}, [f"actor_rollout_ref.rollout.val_kwargs.{override}"])


def test_numbers_given_to_text_keys_are_text():
    cfg = build_config({}, ["trainer.experiment_name=2024", "trainer.project_name=1"])
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.trainer.default_local_dir == "runs/1/2024"
    with pytest.raises(ConfigError, match=r"algorithm\.kl_ctrl\.type"):
        build_config({}, ["algorithm.kl_ctrl.type=1"])  # a choice stays a choice


def test_a_text_key_takes_the_override_as_typed_not_as_yaml_1_1_reads_it():
    # YAML 1.1 reads 2024_01_05 as 20240105, 0123 as 83 (octal) and yes as true
    cfg = build_config(
        {},
        [
            "trainer.experiment_name=2024_01_05",
            "trainer.project_name=0123",
            "actor_rollout_ref.model.tokenizer_path=yes",
            "reward.custom_function=null",  # an optional text key: null is still None
            "launcher.host='10.0.0.1'",  # quoted: YAML removes the quotes
            "actor_rollout_ref.model.path=2024-01-05",  # not a date
            "data.train_batch_size=1_024",  # a number key: YAML's reading stands
        ],
    )
    assert cfg.trainer.experiment_name == "2024_01_05" and cfg.trainer.project_name == "0123"
    assert cfg.trainer.default_local_dir == "runs/0123/2024_01_05"
    assert cfg.actor_rollout_ref.model.tokenizer_path == "yes"
    assert cfg.reward.custom_function is None and cfg.data.train_batch_size == 1024
    assert cfg.launcher.host == "10.0.0.1" and cfg.actor_rollout_ref.model.path == "2024-01-05"


def test_overrides_leave_the_callers_tree_alone():
    tree = {"actor_rollout_ref": {"model": {"path": "m"}}}
    build_config(tree, ["actor_rollout_ref.model.use_remove_padding=true"])
    assert tree == {"actor_rollout_ref": {"model": {"path": "m"}}}
    assert not build_config(tree, []).actor_rollout_ref.model.use_remove_padding


def test_float_and_null_overrides_parse():
    # YAML 1.1 reads 1e-6 as a string; the float key still takes it as a number.
    cfg = build_config(
        {},
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.clip_ratio_high=2.8e-1",
            "trainer.total_training_steps=null",
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        ],
    )
    actor = cfg.actor_rollout_ref.actor
    assert actor.optim.lr == 1e-6 and actor.clip_ratio_high == 0.28
    assert actor.optim.betas == (0.9, 0.95)
    assert cfg.trainer.total_training_steps is None


def test_every_combination_the_schema_refuses_is_named_in_one_message():
    """Before, one at a time: a pasted command line took a round per problem."""
    with pytest.raises(ConfigError) as bad:
        build_config(
            {},
            [
                "trainer.one_step_off_policy=true",
                "algorithm.filter_groups.enable=true",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "critic.ppo_mini_batch_size=3",
            ],
        )
    assert str(bad.value).splitlines() == [
        "invalid config:",
        "  actor_rollout_ref.actor.ppo_mini_batch_size (16) exceeds data.train_batch_size (8)",
        "  data.train_batch_size (8) must be a multiple of critic.ppo_mini_batch_size (3)",
        "  trainer.one_step_off_policy=true does not go with algorithm.filter_groups.enable=true "
        "(dynamic sampling generates until enough groups differ, so the next step's batch "
        "cannot be started ahead): set one of them to false",
    ]


@pytest.mark.parametrize(
    ("given", "trainer", "rollout"),
    [
        ([], "float32", "float32"),  # the CPU: float32 everywhere
        (["trainer.device=cuda"], "bfloat16", "bfloat16"),  # a GPU: verl's bf16 compute
        (["trainer.device=cuda", "actor_rollout_ref.model.dtype=float32"], "float32", "float32"),
        (["trainer.device=cuda", "actor_rollout_ref.rollout.dtype=float16"], "bfloat16", "float16"),
    ],
)
def test_compute_dtypes_follow_the_device_unless_set(given, trainer, rollout):
    """Before, float32 on a GPU too unless set: a verl line, which sets neither, trained
    and generated at half verl's speed, in twice its memory."""
    cfg = build_config({}, given)
    assert cfg.actor_rollout_ref.model.dtype == trainer
    assert cfg.actor_rollout_ref.rollout.dtype == rollout  # the engine's follow the actor's
    assert config_from_yaml(config_to_yaml(cfg)) == cfg  # as the role servers get it


def test_partial_rollouts_keeping_the_kv_cache_are_refused_with_vllm_on_a_gpu_run(monkeypatch):
    vllm = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.partial_rollout=true"]
    with pytest.raises(ConfigError) as bad:
        build_config({}, [*vllm, "trainer.device=cuda"])
    assert str(bad.value).splitlines()[1:] == [
        "  actor_rollout_ref.rollout.partial_rollout_kv=keep does not go with rollout.name=vllm "
        "(vLLM continues the unfinished responses of a partial rollout by prefilling them "
        "again under the new weights): set partial_rollout_kv=recompute, or use "
        "rollout.name=auto, native or fast"
    ]
    recompute = [
        *vllm,
        "trainer.device=cuda",
        "actor_rollout_ref.rollout.partial_rollout_kv=recompute",
    ]
    assert build_config({}, recompute).actor_rollout_ref.rollout.partial_rollout_kv == "recompute"
    # On a CPU run with vllm installed, vLLM generates there too: refused as on a GPU ...
    monkeypatch.setattr(rules, "vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match="partial_rollout_kv=keep does not go with"):
        build_config({}, vllm)
    # ... and without it, the native engine generates, which keeps it.
    monkeypatch.setattr(rules, "vllm_installed", lambda: False)
    assert build_config({}, vllm).actor_rollout_ref.rollout.partial_rollout


def test_null_data_files_are_none_given_not_a_pydantic_error():
    """`data.val_files=null` (verl configs write null for "none"): no validation; before,
    pydantic's `Input should be a valid list (got None)`. A null train_files is then the
    run's own `data.train_files is empty` check."""
    cfg = build_config({}, ["data.val_files=null", "data.train_files=null"])
    assert cfg.data.val_files == [] and cfg.data.train_files == []
    cfg = build_config({"data": {"val_files": None}}, [])
    assert cfg.data.val_files == []


def test_val_max_samples_caps_the_validation_rows_alone(tmp_path):
    """verl's data.val_max_samples: the first N validation rows; data.max_samples caps the
    training rows only (before, it capped both, and nothing capped validation alone)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from meshrl.testing.char_tokenizer import save_char_tokenizer
    from services.coordinator.run.run_data import load_run_data

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Q: {i}+1="}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(6)
    ]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    save_char_tokenizer(tmp_path / "tok")
    base = [
        f"data.train_files={path}", f"data.val_files={path}",
        f"actor_rollout_ref.model.path={tmp_path / 'tok'}", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    data = load_run_data(build_config({}, [*base, "data.val_max_samples=3"]))
    assert data.val_set is not None and data.train_set is not None
    assert [r.ground_truth for r in data.val_set.records] == ["1", "2", "3"]
    assert len(data.train_set) == 6
    data = load_run_data(build_config({}, [*base, "data.max_samples=4"]))
    assert len(data.train_set) == 4 and len(data.val_set) == 6
    # verl's name of the training cap is data.max_samples here
    cfg = build_config({}, ["data.train_max_samples=4", "data.val_max_samples=2"])
    assert (cfg.data.max_samples, cfg.data.val_max_samples) == (4, 2)
