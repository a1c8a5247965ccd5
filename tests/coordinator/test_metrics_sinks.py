"""Metric sinks: TensorBoard event files a user opens with `tensorboard --logdir`,
Weights & Biases runs (offline here: no network), and MLflow runs (in a sqlite store, as
`mlflow ui` reads it)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import struct
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("tensorboard")  # the dev extra installs it
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from meshrl.config import ConfigError, build_config  # noqa: E402
from meshrl.data.errors import DataError  # noqa: E402
from services.coordinator.metrics.sinks import (  # noqa: E402
    ConsoleSink,
    JsonlSink,
    TensorBoardSink,
    close_sinks,
    file_sinks,
)
from services.coordinator.run.preflight import check_run_config  # noqa: E402
from services.coordinator.types import RunEvent, ended_exit_code  # noqa: E402


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_sink_writes_each_finite_metric_at_its_step(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")})
    sink.log(2, {"critic/score/mean": 0.5, "actor/pg_loss": -0.1})
    sink.close()
    got = scalars(tmp_path / "tb")
    assert got["critic/score/mean"] == [(1, 0.25), (2, 0.5)]
    assert got["actor/pg_loss"] == [(2, pytest.approx(-0.1))]  # the NaN is left out


def test_file_sinks_follow_trainer_logger_and_tensorboard_dir(tmp_path, monkeypatch):
    def config(loggers):
        overrides = [f"trainer.logger=[{','.join(loggers)}]", "trainer.project_name=p"]
        return build_config({}, [*overrides, "trainer.experiment_name=e"])

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    sinks = file_sinks(config(["console", "jsonl", "tensorboard"]), tmp_path)
    assert [type(s) for s in sinks] == [JsonlSink, TensorBoardSink]
    assert sinks[1].log_dir == tmp_path / "tensorboard"
    for s in sinks:
        s.close()
    # verl's variable: one folder a run under it, so runs of one service never mix
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TENSORBOARD_DIR", "boards")
    (sink,) = file_sinks(config(["tensorboard"]), tmp_path / "run")
    assert sink.log_dir == tmp_path / "boards" / "p" / "e"
    sink.close()
    assert file_sinks(config(["console"]), tmp_path) == []


@pytest.mark.parametrize("logger", ["tensorboard", "wandb", "mlflow"])
def test_a_logger_without_its_package_is_refused_at_start(monkeypatch, logger):
    pytest.importorskip(logger)  # the dev extras install all three (not the GPU machine)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = build_config({}, [f"trainer.logger=[console,{logger}]"])
    check_run_config(cfg)  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == logger else real(name, *a),
    )
    with pytest.raises(ConfigError, match=rf"trainer.logger includes {logger}.*meshrl\[{logger}\]"):
        check_run_config(cfg)


def test_a_wandb_folder_in_the_working_directory_is_not_the_package(tmp_path, monkeypatch):
    # wandb writes ./wandb by default: found on the path, it is a namespace package
    (tmp_path / "wandb").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(  # as on a machine without the package, with the folder on the path
        importlib.util,
        "find_spec",
        lambda name, *a: (
            importlib.machinery.PathFinder.find_spec(name, [str(tmp_path)])
            if name == "wandb"
            else real(name, *a)
        ),
    )
    assert importlib.util.find_spec("wandb") is not None  # the folder, found
    with pytest.raises(ConfigError, match=r"trainer.logger includes wandb"):
        check_run_config(build_config({}, ["trainer.logger=[console,wandb]"]))


@pytest.fixture
def offline_wandb(monkeypatch):
    wandb = pytest.importorskip("wandb")  # the dev extra installs it
    # wandb keeps its settings in the process: an earlier test's online attempt (in this
    # worker) would be taken up again, and this test would ask for an API key
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, as in CI; `wandb sync` later
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    yield
    wandb.teardown()  # its service process, which would outlive the test otherwise


def recorded_exit_code(folder, wait_s: float = 10.0) -> int | None:
    """The exit code in the offline run's record under ``folder`` (the ``.wandb`` file that
    `wandb sync` uploads: 0 shows as finished, any other code as failed); None when no exit
    record came within ``wait_s``: wandb's service process writes it a moment after
    ``finish()`` has returned."""
    deadline = time.monotonic() + wait_s
    while (code := _exit_code_in(folder)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return code


def _exit_code_in(folder) -> int | None:
    """The file is wandb's LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    (checksum 4 bytes, length 2, kind 1: 1 a whole record, 2-4 its first, middle and last
    parts), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path} is not a wandb run record"
    pos, record, code = header, b"", None
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a chunk: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if pos + header + length > len(data):  # a chunk still being written
            break
        record += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a record complete
            parsed = wandb_internal_pb2.Record.FromString(record)
            record = b""
            if parsed.HasField("exit"):
                code = parsed.exit.exit_code
    return code


def test_wandb_sink_makes_an_offline_run_of_the_experiment(tmp_path, offline_wandb):
    from services.coordinator.metrics.sinks import WandbSink

    sink = WandbSink("proj", "exp", {"data": {"train_batch_size": 4}}, tmp_path)
    sink.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")})
    sink.log(2, {"critic/score/mean": 0.5})
    run = sink.run
    assert (run.project, run.name) == ("proj", "exp")
    assert run.config["data"] == {"train_batch_size": 4}
    assert run.summary["critic/score/mean"] == 0.5
    assert run.summary["training/global_step"] == 2  # the charts' step axis
    assert "actor/pg_loss" not in run.summary.keys()  # the NaN is left out, as for TensorBoard
    # A recovery runs step 2 again: on wandb's own step it would be dropped; here it lands.
    sink.log(2, {"critic/score/mean": 0.75})
    assert run.summary["critic/score/mean"] == 0.75
    print("a line of another run of the service")
    sink.close()
    (record,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # in the run folder
    assert record.stat().st_size > 0
    assert recorded_exit_code(tmp_path) == 0  # closed without a word on the end: finished
    # the console is not captured: each run of a service would record all runs' output
    assert not list(tmp_path.glob("wandb/offline-run-*/files/output.log"))


def test_file_sinks_start_a_wandb_run_under_wandb_dir(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    overrides = ["trainer.logger=[wandb]", "trainer.project_name=p", "trainer.experiment_name=e"]
    (sink,) = file_sinks(
        build_config({}, [*overrides, "data.max_prompt_length=77"]), tmp_path / "run"
    )
    assert sink.run.config["data"]["max_prompt_length"] == 77  # the resolved config
    sink.close()
    assert list((tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb"))
    assert not (tmp_path / "run").exists()


def test_sinks_made_before_one_that_fails_are_closed(tmp_path, monkeypatch):
    from services.coordinator.metrics import sinks as metrics_sinks

    closed = []
    real_close = JsonlSink.close
    monkeypatch.setattr(JsonlSink, "close", lambda self: closed.append(self) or real_close(self))

    def no_board(log_dir):
        raise OSError(f"cannot write {log_dir}")

    monkeypatch.setattr(metrics_sinks, "TensorBoardSink", no_board)
    cfg = build_config({}, ["trainer.logger=[jsonl,tensorboard]"])
    with pytest.raises(OSError, match="cannot write"):  # a failure, not a wrong request
        file_sinks(cfg, tmp_path)
    assert len(closed) == 1 and closed[0].file.closed


class _IdleLauncher:
    """A launcher that starts nothing: the run fails before it would need a server."""

    def start(self):
        return "endpoints"

    def stop(self):
        pass


def _no_ppo_run(*args):
    raise RuntimeError("no PPO run")


def _no_data(cfg, run_dir=None):
    return None  # these runs draw no prompts


def test_a_run_that_cannot_be_made_closes_its_sinks(tmp_path, monkeypatch):
    # e.g. a wandb run started for it would otherwise stay open in the coordinator service
    from services.coordinator.run.run_manager import ManagedRun

    closed = []
    real_close = JsonlSink.close
    monkeypatch.setattr(JsonlSink, "close", lambda self: closed.append(self) or real_close(self))

    cfg = build_config({}, [f"trainer.default_local_dir={tmp_path}"])
    run = ManagedRun("r1", cfg, tmp_path, _IdleLauncher(), _no_ppo_run, _no_data)
    with pytest.raises(RuntimeError, match="no PPO run"):
        run._run()
    assert len(closed) == 1 and closed[0].file.closed


def test_a_logger_that_cannot_start_rejects_the_run_before_its_servers_start(tmp_path, monkeypatch):
    # through a coordinator service: before, the role servers started (and loaded their
    # models) first; now the run is refused (REJECTED, exit 2) and no server starts
    from services.coordinator.metrics import sinks as metrics_sinks
    from services.coordinator.run.run_manager import ManagedRun

    class Launcher(_IdleLauncher):
        started = False

        def start(self):
            Launcher.started = True
            return "endpoints"

    def no_board(log_dir):
        raise ImportError("No module named 'tensorboard'")

    monkeypatch.setattr(metrics_sinks, "TensorBoardSink", no_board)
    overrides = [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl,tensorboard]"]
    run = ManagedRun("r1", build_config({}, overrides), tmp_path, Launcher(), _no_ppo_run, _no_data)
    with pytest.raises(ConfigError, match="trainer.logger includes tensorboard"):
        run._run()
    assert not Launcher.started


def test_a_finished_run_started_again_succeeds_without_starting_a_server(tmp_path):
    """Through a coordinator service: the run ends SUCCEEDED, its message saying why."""
    from services.coordinator.run.run_manager import ManagedRun
    from services.coordinator.types import AlreadyTrained, RunState

    class Launcher(_IdleLauncher):
        started = False

        def start(self):
            Launcher.started = True
            return "endpoints"

    def trained(cfg, run_dir):
        assert run_dir == tmp_path  # where resume_mode=auto looks: the run's own folder
        raise AlreadyTrained("nothing to train: the run's checkpoint is at step 4", 4, 4)

    cfg = build_config({}, [f"trainer.default_local_dir={tmp_path}"])
    run = ManagedRun("r1", cfg, tmp_path, Launcher(), _no_ppo_run, trained)
    assert run._run() == (RunState.SUCCEEDED, "nothing to train: the run's checkpoint is at step 4")
    assert not Launcher.started
    # it ends at its checkpoint's step (before: `SUCCEEDED step 0`)
    assert (run.status.step, run.status.total_steps) == (4, 4)


@pytest.mark.parametrize(
    ("error", "finished", "code"),
    [
        (None, True, 0),  # every step done
        (None, False, 3),  # stopped early (StopRun, a first Ctrl-C): not a success
        (RuntimeError("actor died"), False, 1),
        (ConfigError("actor_rollout_ref.model.path is empty"), False, 2),
        (DataError("data.train_files: no rows"), False, 2),
        (KeyboardInterrupt(), False, 130),  # a second Ctrl-C abandoned the step
    ],
)
def test_each_end_of_a_run_has_the_exit_code_meshrl_run_exits_with(error, finished, code):
    assert ended_exit_code(error, finished) == code


def test_a_stopped_run_is_not_recorded_as_finished_and_other_sinks_close_as_before(
    tmp_path, offline_wandb
):
    from services.coordinator.metrics.sinks import WandbSink

    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    wandb_sink = WandbSink("proj", "exp", {}, tmp_path)
    wandb_sink.log(1, {"critic/score/mean": 0.25})
    close_sinks([ConsoleSink(write=lambda line: None), jsonl, wandb_sink], exit_code=3)
    assert recorded_exit_code(tmp_path) == 3  # wandb shows the run failed
    assert jsonl.file.closed


def test_a_run_whose_setup_fails_marks_its_wandb_run_failed(tmp_path, offline_wandb):
    from services.coordinator.run.run import Endpoints, PPORun

    nowhere = Endpoints(rollout=["127.0.0.1:9"], actor="127.0.0.1:9", reward="127.0.0.1:9")
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={tmp_path / 'no-model'}",
            "trainer.logger=[wandb]",
            "trainer.plot=false",
        ],
    )
    run = PPORun(cfg, nowhere, tmp_path / "run")  # channels open lazily: nothing is called
    with pytest.raises(ConfigError) as e:
        run.setup()
    run.close(error=e.value)
    assert recorded_exit_code(tmp_path / "run") == 2  # as `meshrl run` exits: rejected


def test_a_run_that_cannot_be_made_marks_its_wandb_run_failed(tmp_path, offline_wandb):
    from services.coordinator.run.run_manager import ManagedRun

    overrides = [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[wandb]"]
    run = ManagedRun(
        "r1", build_config({}, overrides), tmp_path, _IdleLauncher(), _no_ppo_run, _no_data
    )
    with pytest.raises(RuntimeError, match="no PPO run"):
        run._run()
    assert recorded_exit_code(tmp_path) == 1


def test_a_managed_run_whose_training_fails_closes_its_run_with_the_error(tmp_path):
    from services.coordinator.run.run_manager import ManagedRun

    closed = []

    class FailingPPO:
        total_steps, progress = 4, SimpleNamespace(step=0)
        checkpoints = SimpleNamespace(resumed_from=None)

        def setup(self, data=None):
            pass

        def train(self):
            raise RuntimeError("actor died")

        def close(self, error=None):
            closed.append(error)

    cfg = build_config({}, [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[]"])
    run = ManagedRun("r1", cfg, tmp_path, _IdleLauncher(), lambda *args: FailingPPO(), _no_data)
    with pytest.raises(RuntimeError, match="actor died"):
        run._run()
    (error,) = closed  # its sinks learn the run failed: a wandb run is marked so
    assert ended_exit_code(error, finished=False) == 1


# ---- MLflow ---------------------------------------------------------------------------------


def mlflow_config(tmp_path, loggers="[console,mlflow]"):
    return build_config(
        {},
        [
            f"trainer.logger={loggers}",
            "trainer.project_name=gsm8k_ppo",
            "trainer.experiment_name=qwen_lr1e-6",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "actor_rollout_ref.actor.ppo_epochs=3",
        ],
    )


def test_mlflow_run_holds_the_config_each_finite_metric_and_how_the_run_ended(
    tmp_path, monkeypatch
):
    pytest.importorskip("mlflow")  # the dev extra installs mlflow-skinny and SQLAlchemy
    from mlflow import MlflowClient

    from services.coordinator.metrics.sinks import MlflowSink, mlflow_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = mlflow_config(tmp_path)
    check_run_config(cfg)  # SQLAlchemy is there: the default sqlite store is usable
    run_dir = tmp_path / "run"
    ends = {}
    for exit_code in (0, 3, 1):  # finished; stopped (a first Ctrl-C); failed
        (sink,) = file_sinks(cfg, run_dir)
        assert isinstance(sink, MlflowSink)
        sink.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")})
        sink.log(2, {"critic/score/mean": 0.5, "val-core/gsm8k/reward/mean@4": 0.75})
        close_sinks([sink], exit_code)
        ends[exit_code] = sink.run_id

    uri = mlflow_tracking_uri(run_dir)
    assert uri == f"sqlite:///{run_dir.absolute() / 'mlflow.db'}"
    assert (run_dir / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("gsm8k_ppo")  # one, made by the first run
    runs = client.search_runs([experiment.experiment_id])
    assert {r.info.run_id for r in runs} == set(ends.values())
    status = {code: client.get_run(run_id).info.status for code, run_id in ends.items()}
    assert status == {0: "FINISHED", 3: "KILLED", 1: "FAILED"}
    run = client.get_run(ends[0])
    assert run.info.run_name == "qwen_lr1e-6"
    assert run.data.params["actor_rollout_ref/actor/ppo_epochs"] == "3"
    assert run.data.params["trainer/project_name"] == "gsm8k_ppo"
    assert run.data.tags["meshrl.run_dir"] == str(run_dir.absolute())

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(ends[0], key)]

    assert sorted(history("critic/score/mean")) == [(1, 0.25), (2, 0.5)]
    assert history("actor/pg_loss") == []  # the NaN is left out
    assert history("val-core/gsm8k/reward/mean_at_4") == [(2, 0.75)]  # "@" refused


def test_mlflow_tracking_uri_comes_from_the_environment_as_verl_reads_it(tmp_path, monkeypatch):
    from services.coordinator.metrics.sinks import mlflow_metric_name, mlflow_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert mlflow_tracking_uri(tmp_path) == "http://tracking:5000"
    assert mlflow_metric_name("val-aux/math/acc/best@8/mean") == "val-aux/math/acc/best_at_8/mean"
    assert mlflow_metric_name("perf/mfu/actor (%)") == "perf/mfu/actor ___"


def test_a_database_store_without_sqlalchemy_is_refused_at_start(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    cfg = mlflow_config(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(  # as with mlflow-skinny alone
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("sqlalchemy", "alembic") else real(name, *a),
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_URI unset.*sqlalchemy and alembic"):
        check_run_config(cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg2://db/mlflow")
    with pytest.raises(ConfigError, match=r"postgresql\+psycopg2://db/mlflow.*meshrl\[mlflow\]"):
        check_run_config(cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")  # a server: no database here
    check_run_config(cfg)


def test_wandb_shows_validation_samples_as_verls_table(tmp_path, offline_wandb):
    from services.coordinator.metrics.generations import GenerationRow
    from services.coordinator.metrics.sinks import WandbSink, log_generations

    sink = WandbSink("proj", "exp", {}, tmp_path)
    rows = [GenerationRow("1+2=", "3", 1.0), GenerationRow("2+2=", "5", 0.0)]
    log_generations([ConsoleSink(write=lambda line: None), sink], 2, rows)
    log_generations([sink], 4, [r._replace(score=1.0) for r in rows])
    close_sinks([sink], 0)
    # the table as wandb stores it in the offline run (what `wandb sync` uploads)
    tables = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/val/generations_*.json"))
    assert tables, "no table file"
    table = json.loads(tables[-1].read_text())  # the last log holds both validations
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2",
                                "score_2"]  # fmt: skip
    assert table["data"] == [[2, "1+2=", "3", 1.0, "2+2=", "5", 0.0],
                             [4, "1+2=", "3", 1.0, "2+2=", "5", 1.0]]  # fmt: skip


def test_a_logger_that_cannot_show_samples_does_not_end_the_run(tmp_path, caplog):
    from services.coordinator.metrics.generations import GenerationRow
    from services.coordinator.metrics.sinks import log_generations

    class Broken:
        def log_generations(self, step, rows):
            raise OSError("disk full")

    board = TensorBoardSink(tmp_path / "tb")
    sample = GenerationRow("a|b 2*3*4", "c\r\nd __init__", 0.5)
    log_generations([Broken(), board], 3, [sample])
    board.close()
    assert "could not log validation samples to Broken: disk full" in caplog.text
    from tests.e2e.test_ppo_run import board_texts

    ((step, text),) = board_texts(tmp_path / "tb", "val/generations")
    # as written: no emphasis out of 2*3*4, no bold out of __init__, one row despite CR LF
    assert step == 3 and r"| a\|b 2\*3\*4 | c<br>d \_\_init\_\_ | 0.5 |" in text


def test_mlflow_names_never_read_as_paths():
    from services.coordinator.metrics.sinks import mlflow_metric_name

    # a data_source may be "" (a custom reward function scores every source)
    assert mlflow_metric_name("val-core//acc/mean@1") == "val-core/_/acc/mean_at_1"
    assert mlflow_metric_name("val-aux/./gsm8k/") == "val-aux/_/gsm8k/_"
    assert mlflow_metric_name("/a/../b") == "_/a/_/b"


def test_an_mlflow_outage_mid_run_costs_its_points_not_the_run(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from services.coordinator.metrics.sinks import MlflowSink

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sink = MlflowSink("p", "e", {}, tmp_path)
    sink.log(1, {"critic/score/mean": 0.25, "val-core//acc/mean@1": 1.0})
    real = MlflowClient.log_batch

    def down(self, *args, **kwargs):
        raise MlflowException("API request to http://tracking:5000 failed: max retries")

    monkeypatch.setattr(MlflowClient, "log_batch", down)
    sink.log(2, {"critic/score/mean": 0.5})  # warns, does not raise
    monkeypatch.setattr(MlflowClient, "log_batch", real)
    sink.log(3, {"critic/score/mean": 0.75})
    close_sinks([sink], 0)
    assert "MLflow did not take the metrics of step 2" in caplog.text
    client = MlflowClient(tracking_uri=sink.uri)
    steps = [m.step for m in client.get_metric_history(sink.run_id, "critic/score/mean")]
    assert sorted(steps) == [1, 3]
    assert [m.step for m in client.get_metric_history(sink.run_id, "val-core/_/acc/mean_at_1")] == [
        1
    ]


def test_an_mlflow_run_whose_start_fails_is_not_left_running(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from services.coordinator.metrics.sinks import MlflowSink, mlflow_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def no_params(self, run_id, metrics=(), params=(), tags=()):
        raise OSError("disk full")

    monkeypatch.setattr(MlflowClient, "log_batch", no_params)
    with pytest.raises(OSError, match="disk full"):
        MlflowSink("p", "e", {"a": 1}, tmp_path)
    client = MlflowClient(tracking_uri=mlflow_tracking_uri(tmp_path))
    (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert run.info.status == "FAILED"


def test_each_finished_run_frees_its_own_stores_database_engine(tmp_path, monkeypatch):
    # a coordinator service runs many runs, each with a store of its own
    pytest.importorskip("mlflow")
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from services.coordinator.metrics.sinks import MlflowSink

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sinks = [MlflowSink("p", "e", {}, tmp_path / f"run{i}") for i in range(3)]
    assert all(s.uri in SqlAlchemyStore._engine_map for s in sinks)
    close_sinks(sinks, 0)
    assert not any(s.uri in SqlAlchemyStore._engine_map for s in sinks)


def test_only_a_refusal_of_the_settings_is_a_wrong_request():
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
    from wandb.errors import CommError, UsageError

    from services.coordinator.metrics.sinks import _is_refusal

    assert _is_refusal(UsageError("No API key configured. Use `wandb login` to log in."))
    assert _is_refusal(ImportError("No module named 'tensorboard'"))
    assert _is_refusal(MlflowException("bad experiment", error_code=INVALID_PARAMETER_VALUE))
    # a server that does not answer, a network blip, a full disk: the run failed (exit 1)
    assert not _is_refusal(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))
    assert not _is_refusal(CommError("timed out"))
    assert not _is_refusal(OSError("No space left on device"))


@pytest.mark.parametrize(("kind", "line"), [
    ("local", "starting role servers (local launcher)"),
    ("external", "connecting to the role servers (external launcher)"),  # it starts none
])  # fmt: skip
def test_a_runs_status_line_says_what_its_launcher_does(tmp_path, kind, line):
    from services.coordinator.run.run_manager import ManagedRun

    cfg = build_config({}, [f"trainer.default_local_dir={tmp_path}", f"launcher.kind={kind}"])
    run = ManagedRun("r1", cfg, tmp_path, _IdleLauncher(), _no_ppo_run, _no_data)
    with pytest.raises(RuntimeError, match="no PPO run"):
        run._run()
    run.events.append(RunEvent(run.status, {}, "end"), close=True)
    assert line in [event.log_line for event in run.events.follow()]
