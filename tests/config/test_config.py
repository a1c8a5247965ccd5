import pytest

from meshrl.config import ConfigError, build_config, config_from_yaml, config_to_yaml, load_config


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

    assert compute_dtype(build_config({}, [])) is None  # float32 everywhere by default
    assert compute_dtype(build_config({}, ["actor_rollout_ref.model.dtype=bfloat16"])) == "bfloat16"
    both = ["actor_rollout_ref.model.dtype=bfloat16", "critic.model.dtype=float32"]
    assert compute_dtype(build_config({}, both)) == "float32"
