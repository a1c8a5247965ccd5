"""`meshrl run`'s exit codes, the same with or without --coordinator: 0 succeeded, 1 the run
failed, 2 the request is wrong, 3 stopped (after its checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

import meshrl_app.run_local as run_local_module
from meshrl.rpc.role_client import RoleCallError
from meshrl_app import cli
from meshrl_app.run_local import RunResult
from services.coordinator.recovery.checkpointing import CheckpointError
from services.coordinator.step.scoring import RewardFailedEverySample
from services.coordinator.types import ended_exit_code


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    # a training file is named, as every run must (these runs end before reading it)
    path.write_text(
        "data: {train_files: [unread.parquet]}\nactor_rollout_ref: {model: {path: unread}}\n"
    )
    return str(path)


def _no_data(cfg, run_dir=None):
    return None  # these runs end before drawing a prompt: no data file or model is read


def _run_ends_with(monkeypatch, outcome):
    def fake_run_local(cfg, stop=None):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(run_local_module, "run_local", fake_run_local)


def test_a_finished_run_exits_0(monkeypatch, config):
    _run_ends_with(monkeypatch, RunResult({"critic/score/mean": 0.5}, finished=True))
    assert cli.main(["run", config]) == cli.EXIT_SUCCEEDED == 0


def test_a_stopped_run_exits_3_as_through_the_coordinator(monkeypatch, config):
    _run_ends_with(monkeypatch, RunResult({"critic/score/mean": 0.5}, finished=False))
    assert cli.main(["run", config]) == cli.EXIT_STOPPED == 3


@pytest.mark.parametrize(
    "error",
    [
        RoleCallError("actor", "127.0.0.1:2", "Update", Unavailable()),
        CheckpointError("could not write the checkpoint of step 4: No space left on device"),
        RewardFailedEverySample("reward: 8 of 8 samples could not be scored and count as 0"),
    ],
)
def test_a_failed_run_exits_1_not_as_a_bad_config(monkeypatch, config, capsys, error):
    _run_ends_with(monkeypatch, error)
    assert cli.main(["run", config]) == cli.EXIT_FAILED == 1
    assert str(error) in capsys.readouterr().err


class _Launcher:
    def __init__(self, cfg, run_dir):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def start(self):
        return "endpoints"

    def stop(self):
        pass


def _launcher_recording_into(started: list) -> type:
    """A stand-in launcher class whose start() appends True to ``started``."""

    class Launcher(_Launcher):
        def start(self):
            started.append(True)
            return "endpoints"

    return Launcher


@pytest.mark.parametrize(
    "outcome",
    [
        "finished",
        "stopped",
        RoleCallError("actor", "127.0.0.1:2", "Update", Unavailable()),
        KeyboardInterrupt("signal 2"),  # the second Ctrl-C
    ],
)
def test_the_run_closes_knowing_how_it_ended_as_meshrl_run_exits(
    monkeypatch, tmp_path, config, outcome
):
    # what its sinks record (a wandb run: finished or failed) is the command's exit code
    closed = []

    class Run:
        finished = outcome == "finished"
        progress, total_steps = SimpleNamespace(step=1), 1
        checkpoints = SimpleNamespace(resumed_from=None)

        def __init__(self, *args, **kwargs):
            pass

        def setup(self, data=None):
            pass

        def train(self):
            if isinstance(outcome, BaseException):
                raise outcome
            return {"critic/score/mean": 0.5}

        def stop(self):
            pass

        def close(self, error=None):
            closed.append(ended_exit_code(error, self.finished))

    monkeypatch.setattr(run_local_module, "PPORun", Run)
    monkeypatch.setattr(run_local_module, "make_launcher", _Launcher)
    monkeypatch.setattr(run_local_module, "check_run_config", lambda cfg: None)
    monkeypatch.setattr(run_local_module, "load_run_data", _no_data)
    exit_code = cli.main(["run", config, f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert closed == [exit_code]


def test_run_result_is_the_last_metrics():
    result = RunResult({"a": 1.0}, finished=True)
    assert result == {"a": 1.0} and result["a"] == 1.0 and result.finished


def test_a_logger_that_cannot_start_ends_the_run_before_any_server_starts(
    monkeypatch, tmp_path, config, capsys
):
    # wandb online without an API key: before, the run failed (exit 1) once every role
    # server was up and its model loaded; now it is refused (exit 2) before the launch
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # the process-wide settings of an earlier wandb test
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: no key
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    started = []
    Launcher = _launcher_recording_into(started)
    monkeypatch.setattr(run_local_module, "make_launcher", Launcher)
    monkeypatch.setattr(run_local_module, "load_run_data", _no_data)
    run_dir = tmp_path / "run"
    overrides = [f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl,wandb]"]
    exit_code = cli.main(["run", config, *overrides])
    err = capsys.readouterr().err
    assert exit_code == cli.EXIT_BAD_REQUEST == 2, err
    assert "trainer.logger includes wandb, but it could not start" in err
    assert "API key" in err
    assert started == []
    assert (run_dir / "metrics.jsonl").exists()  # the sink made before it was closed
    wandb.teardown()  # not the online settings for the next wandb test in this process


def test_a_wrong_address_list_ends_the_run_before_the_loggers_open(
    monkeypatch, tmp_path, config, capsys
):
    # before, the external launcher found it after the loggers had opened: a failed MLflow
    # or wandb run was left behind for a run that never started. No logger opens now: not
    # even the jsonl file in the run folder.
    run_dir = tmp_path / "run"
    exit_code = cli.main(
        [
            "run",
            config,
            f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[console,jsonl]",
            "launcher.kind=external",
            "launcher.addresses={rollout: ['127.0.0.1:1'], reward: ['127.0.0.1:2']}",
        ]
    )
    err = capsys.readouterr().err
    assert exit_code == cli.EXIT_BAD_REQUEST == 2, err
    assert "launcher.addresses.actor: no address given" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("where", ["a_file", "/proc/no/such/folder"])
def test_a_run_folder_that_cannot_be_made_is_a_bad_request(tmp_path, config, capsys, where):
    """Before: a FileExistsError / FileNotFoundError traceback, exit 1."""
    path = tmp_path / where if where == "a_file" else where
    if where == "a_file":
        path.write_text("not a folder")
    assert cli.main(["run", config, f"trainer.default_local_dir={path}"]) == 2
    err = capsys.readouterr().err
    why = "a file of that name exists" if where == "a_file" else "No such file or directory"
    assert f"meshrl: trainer.default_local_dir: cannot use {path} as the run folder: {why}" in err


@pytest.mark.parametrize("key", ["rollout_data_dir", "validation_data_dir"])
def test_a_generations_folder_that_cannot_be_made_is_a_bad_request_at_start(
    tmp_path, config, capsys, key
):
    """Before: a FileExistsError traceback, exit 1, at the end of the first step (after its
    generation and updates) or of the first validation."""
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    args = [
        "run",
        config,
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"trainer.{key}={taken}",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"meshrl: trainer.{key}: cannot write generations to {taken}: a file of that" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before the run began"


def test_a_run_without_training_files_is_refused_before_any_server_starts(tmp_path, capsys):
    """Before, the role servers started and loaded their models first, and the run then
    failed with `no data files given`, which names no key."""
    empty = tmp_path / "run.yaml"
    empty.write_text("{}\n")
    assert cli.main(["run", str(empty), f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    # both keys every run needs, in one message (before: the model's only on a second try)
    assert "meshrl: invalid config:\n  data.train_files is empty: name the training parquet" in err
    assert "\n  actor_rollout_ref.model.path is empty: set it to a Hugging Face model" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cuda_build", [True, False])
def test_cuda_on_a_machine_without_a_gpu_is_a_bad_request_before_any_server_starts(
    monkeypatch, tmp_path, config, capsys, cuda_build
):
    """verl's default device. Before: exit 1 after every server had started, each failing
    its Initialize with `Torch not compiled with CUDA enabled`."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: cuda_build)
    run_dir = tmp_path / "run"
    args = ["run", config, f"trainer.default_local_dir={run_dir}", "trainer.device=cuda"]
    assert cli.main(args) == 2
    why = "sees no CUDA GPU" if cuda_build else "is a CPU-only build"
    assert f"meshrl: trainer.device=cuda, but torch here {why}" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from meshrl.testing.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("model"))


def _small_run_args(config, model_dir, tmp_path, *extra: str) -> list[str]:
    """`meshrl run` of the tiny model on 16 arithmetic prompts, its folder tmp_path/run."""
    from meshrl_app.demo.arithmetic import write_arithmetic_parquet

    train = write_arithmetic_parquet(tmp_path / "data", n_train=16, n_val=8)["train"]
    return [
        "run",
        config,
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[console]",
        *extra,
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train_files=[{tmp}/missing.parquet]", "missing.parquet does not exist"),
        ("data.val_files=[{tmp}/not_parquet.parquet]", "is not a readable parquet file"),
        ("actor_rollout_ref.model.path={tmp}/no-model", "actor_rollout_ref.model.path"),
        ("trainer.resume_mode={tmp}/no-checkpoint", "trainer.resume_mode: "),
    ],
)
def test_data_model_and_checkpoint_paths_are_checked_before_any_server_starts(
    monkeypatch, tmp_path, config, model_dir, capsys, override, message
):
    """Before: each came after every role server had started and loaded its model (15 to
    20 s on two cores), from the run's set-up."""
    started = []
    monkeypatch.setattr(run_local_module, "make_launcher", _launcher_recording_into(started))
    (tmp_path / "not_parquet.parquet").write_text("a,b\n1,2\n")
    args = _small_run_args(config, model_dir, tmp_path, override.format(tmp=tmp_path))
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert started == [], "refused before the launch"


def test_a_finished_run_run_again_ends_at_once_with_nothing_to_train(
    monkeypatch, tmp_path, config, model_dir, capsys, caplog
):
    """Before: every role server started and loaded its model, a warning came, exit 0."""
    from services.coordinator.recovery.checkpointing import CheckpointManager, CoordinatorState

    started = []
    monkeypatch.setattr(run_local_module, "make_launcher", _launcher_recording_into(started))
    run_dir = tmp_path / "run"
    loader = {"epoch": 0, "batch_in_epoch": 2, "seed": 1}
    state = CoordinatorState.capture(2, loader, {"type": "fixed", "value": 0.001}, 2)
    CheckpointManager(run_dir).save(2, state, "", lambda tmp: (tmp / "actor").mkdir())
    args = _small_run_args(config, model_dir, tmp_path, "trainer.total_training_steps=2")
    with caplog.at_level("INFO"):
        assert cli.main(args) == 0
    said = "nothing to train: the run's checkpoint is at step 2, and the run has 2 steps"
    out = capsys.readouterr().out
    assert said not in caplog.text, "said once, by the last line"
    # before: said in a warning, then `meshrl: run finished; run folder ... (metrics.jsonl,
    # checkpoints/)` though no metrics.jsonl was there (trainer.logger=[console])
    assert out.splitlines()[-1].startswith(f"meshrl: {said}")
    assert out.splitlines()[-1].endswith(
        f"no role server was started; run folder {run_dir} (checkpoints/global_step_2)"
    )
    assert out.count("nothing to train") == 1
    assert started == [], "no server was started"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--detach"], "--detach leaves a run to a coordinator service: give --coordinator"),
        (["-"], "config '-' (standard input) is read only with --coordinator"),
    ],
)
def test_coordinator_only_arguments_of_a_local_run_are_a_bad_request(
    monkeypatch, capsys, config, argv, message
):
    """Before: --detach ran the whole job here in the foreground, exit 0; '-' said
    `config file - does not exist`."""
    ran = []
    monkeypatch.setattr(run_local_module, "run_local", lambda cfg: ran.append(cfg))
    args = ["run", *argv] if argv == ["-"] else ["run", *argv, config]
    assert cli.main(args) == 2
    assert f"meshrl: {message}" in capsys.readouterr().err
    assert ran == []


def test_a_local_run_ends_naming_its_folder(monkeypatch, tmp_path, capsys, config):
    result = RunResult({}, finished=True, step=4, total_steps=4)
    monkeypatch.setattr(run_local_module, "run_local", lambda cfg, stop=None: result)
    assert cli.main(["run", config, f"trainer.default_local_dir={tmp_path / 'r'}"]) == 0
    said = f"meshrl: run finished at step 4 of 4; run folder {tmp_path / 'r'}"
    assert said in capsys.readouterr().out
