"""Where step metrics go: the console (one line per step), a JSONL file, TensorBoard,
Weights & Biases, MLflow."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Protocol

from meshrl.config.schema import RunConfig
from services.coordinator.metrics.generations import GenerationRow
from services.coordinator.types import INTERRUPTED_EXIT_CODE, RunState, ended_exit_code

log = logging.getLogger(__name__)

CONSOLE_KEYS = [
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/reward_kl_penalty", "kl"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
]


class MetricsSink(Protocol):
    """Where step metrics go. A sink that records how the run ended (a wandb run: finished,
    or failed) has ``finish(exit_code)`` as well, which close_sinks calls in place of close:
    the others need not know. A sink that can show validation samples as a table has
    ``log_generations(step, rows)`` (rows of :class:`GenerationRow`; see
    :func:`log_generations`)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"step": k, "<metric>": value, ...}; appends on resume."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars in TensorBoard event files (``tensorboard --logdir <dir>``), one per metric
    and step, written through torch's SummaryWriter; needs the ``tensorboard`` package."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # only when this logger is on

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, step: int, rows: list[GenerationRow]) -> None:
        """A markdown table under the text tab, ``val/generations`` at ``step``."""
        lines = ["| input | output | score |", "|---|---|---|"]
        lines += [f"| {_cell(r.input)} | {_cell(r.output)} | {r.score:.4g} |" for r in rows]
        self.writer.add_text(GENERATIONS_KEY, "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (verl's ``wandb`` logger): project ``trainer.project_name``,
    name ``trainer.experiment_name``, the resolved config; its files under the run folder
    (``$WANDB_DIR`` wins). Online or offline as ``$WANDB_MODE`` says (offline needs no
    network; ``wandb sync`` uploads later). Needs the ``wandb`` package.

    Charts are drawn against ``training/global_step``, not wandb's own step: wandb's step
    may only grow, so the steps a recovery runs again (after rewinding to a checkpoint)
    would be dropped; on this axis they are kept, as metrics.jsonl keeps them. The
    console is not captured: a coordinator service runs several runs in one process, and
    each run would record all of their output."""

    STEP = "training/global_step"

    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import wandb  # only when this logger is on

        where = os.environ.get("WANDB_DIR") or str(run_dir)
        Path(where).mkdir(parents=True, exist_ok=True)
        # One run object each: a coordinator service runs several at once in one process.
        self.run = wandb.init(
            project=project,
            name=name,
            config=config,
            dir=where,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)
        self._table_columns: list[str | int] = []
        self._table_rows: list[list] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # One call a step, committed at once: a crash must not take the last step with it.
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        self.run.log({**finite, self.STEP: step})

    def log_generations(self, step: int, rows: list[GenerationRow]) -> None:
        """verl's ``val/generations`` table: a row a validation (its step, then input,
        output and score of each shown sample), the whole table logged again each time
        (wandb keeps a logged table as it was)."""
        import wandb

        columns: list[str | int] = ["step"]  # wandb.Table's type
        for i in range(1, len(rows) + 1):
            columns += [f"input_{i}", f"output_{i}", f"score_{i}"]
        row = [step] + [x for r in rows for x in (r.input, r.output, r.score)]
        if columns != self._table_columns:  # another count of samples: a fresh table
            self._table_columns, self._table_rows = columns, []
        self._table_rows.append(row)
        table = wandb.Table(columns=columns, data=self._table_rows)
        self.run.log({GENERATIONS_KEY: table, self.STEP: step})

    def finish(self, exit_code: int) -> None:
        """Ends the run, recording how: 0 marks it finished, any other code failed
        (``ended_exit_code`` says which code each end gets)."""
        self.run.finish(exit_code=exit_code)

    def close(self) -> None:
        # Closed without a word on how the run ended: finished, as wandb's own default.
        # The coordinator closes its sinks through close_sinks, which says.
        self.finish(0)


class MlflowSink:
    """An MLflow run (verl's ``mlflow`` logger): experiment ``trainer.project_name``, run
    name ``trainer.experiment_name``, the resolved config as its parameters (keys joined
    by "/" as verl's: ``actor_rollout_ref/actor/ppo_epochs``), one batch of metrics a
    step. Where: :func:`mlflow_tracking_uri`. Written through an ``MlflowClient`` bound to
    this run's id, not MLflow's process-wide active run: a coordinator service runs
    several runs in one process. Needs ``mlflow-skinny``, and SQLAlchemy for a database
    store (``pip install 'meshrl[mlflow]'``).

    MLflow allows only letters, digits and ``_-. :/`` in a name: validation metrics such
    as ``val-core/gsm8k/reward/mean@4`` are logged as ``...mean_at_4`` (verl's spelling),
    any other character becomes ``_``. A run ends FINISHED (exit code 0), KILLED (stopped:
    3, or interrupted: 130) or FAILED (any other code)."""

    BATCH = 1000  # MLflow's most metrics in one log_batch call
    PARAMS_BATCH = 100  # its most params in one
    PARAM_VALUE_CHARS = 6000  # its longest param value

    def __init__(self, experiment: str, name: str, config: dict, run_dir: Path):
        from mlflow import MlflowClient  # only when this logger is on
        from mlflow.entities import Param

        self.uri = mlflow_tracking_uri(run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        # With the default store in the run folder, its artifacts go there too (MLflow's
        # default would be ./mlruns in the working directory). With $MLFLOW_TRACKING_URI a
        # tracking server decides; a database URI gets MLflow's default, ./mlruns.
        self.own_store = not os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if self.own_store:
            artifacts = (Path(run_dir) / "mlflow-artifacts").absolute().as_uri()
        self.run_id = self.client.create_run(
            self._experiment_id(experiment, artifacts),
            run_name=name,
            tags={"meshrl.run_dir": str(Path(run_dir).absolute())},
        ).info.run_id
        params = [
            Param(key, value[: self.PARAM_VALUE_CHARS]) for key, value in _flatten(config).items()
        ]
        try:
            for start in range(0, len(params), self.PARAMS_BATCH):
                batch = params[start : start + self.PARAMS_BATCH]
                self.client.log_batch(self.run_id, params=batch)
        except BaseException as e:  # the run exists now: not left RUNNING for ever
            interrupted = isinstance(e, KeyboardInterrupt)
            try:
                self.finish(INTERRUPTED_EXIT_CODE if interrupted else RunState.FAILED.exit_code)
            except Exception as closing:  # noqa: BLE001 - the first error is the one to see
                log.warning("could not end the MLflow run %s: %s", self.run_id, closing)
            raise

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # made meanwhile by another run of the same service
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(mlflow_metric_name(k), float(v), now, step)
            for k, v in metrics.items()
            if math.isfinite(v)
        ]
        try:
            for start in range(0, len(rows), self.BATCH):
                self.client.log_batch(self.run_id, metrics=rows[start : start + self.BATCH])
        except Exception as e:  # noqa: BLE001 - a logger's outage is not the run's failure
            # After MLflow's own retries: this step's points are lost to MLflow only
            # (metrics.jsonl and the other loggers have them), the run goes on.
            log.warning("MLflow did not take the metrics of step %d: %s", step, e)

    def log_generations(self, step: int, rows: list[GenerationRow]) -> None:
        """An artifact ``val_generations/step_<step>.json``: {"step", "rows": [{input,
        output, score}]} (verl logs the same rows as an artifact)."""
        body = {"step": step, "rows": [r._asdict() for r in rows]}
        self.client.log_text(self.run_id, json.dumps(body), f"val_generations/step_{step}.json")

    def finish(self, exit_code: int) -> None:
        """Ends the run: FINISHED for 0, KILLED for a stop (3) or interrupt (130), else
        FAILED (``ended_exit_code`` says which code each end gets)."""
        if exit_code == 0:
            status = "FINISHED"
        elif exit_code in (RunState.STOPPED.exit_code, INTERRUPTED_EXIT_CODE):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            self.client.set_terminated(self.run_id, status=status)
        finally:
            if self.own_store:
                _dispose_store(self.uri)

    def close(self) -> None:
        self.finish(0)


def _dispose_store(uri: str) -> None:
    """Closes MLflow's database engine for ``uri``. MLflow keeps one per URI for the life
    of the process, and each run's own store is a new URI: a coordinator service would hold
    a few file handles per finished run. (A private MLflow attribute, hence guarded.)"""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()
    except Exception as e:  # noqa: BLE001 - an MLflow without this map: nothing to free
        log.debug("could not dispose of MLflow's engine for %s: %s", uri, e)


GENERATIONS_KEY = "val/generations"


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~])")


def _cell(text: str) -> str:
    """``text`` as itself in one markdown table cell: markdown's special characters
    backslash-escaped (``2*3*4`` is no emphasis, ``__init__`` not bold), every line break
    (CR LF, CR, LF) as <br>. TensorBoard escapes < and > itself."""
    escaped = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    return re.sub(r"\r\n|\r|\n", "<br>", escaped)


def log_generations(sinks: list[MetricsSink], step: int, rows: list[GenerationRow]) -> None:
    """The shown validation samples to every sink that keeps tables (the others have no
    ``log_generations``); a sink that fails to is logged, not fatal: the metrics went."""
    for sink in sinks:
        show = getattr(sink, "log_generations", None)
        if show is None:
            continue
        try:
            show(step, rows)
        except Exception as e:  # noqa: BLE001 - a table is a convenience, not the run
            log.warning("could not log validation samples to %s: %s", type(sink).__name__, e)


def mlflow_tracking_uri(run_dir: Path) -> str:
    """``$MLFLOW_TRACKING_URI`` (a tracking server, ``http://host:5000``, or a database, as
    verl reads it); unset: ``sqlite:///<run folder>/mlflow.db``, which ``mlflow ui
    --backend-store-uri`` opens. Several runs compared side by side need one URI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').absolute()}"


_MLFLOW_NAME_REFUSED = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_metric_name(key: str) -> str:
    """``key`` as MLflow accepts it: "@" spelled "_at_", other refused characters "_", and
    an empty, "." or ".." part between slashes "_" (MLflow refuses names that read as
    paths: a ``data_source`` may be "", which makes ``val-core//acc/mean@1``)."""
    name = _MLFLOW_NAME_REFUSED.sub("_", key.replace("@", "_at_"))
    return "/".join(part if part not in ("", ".", "..") else "_" for part in name.split("/"))


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a/b": "1"}; lists and scalars as their JSON text."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "/"))
        else:
            flat[mlflow_metric_name(name)] = value if isinstance(value, str) else json.dumps(value)
    return flat


def tensorboard_dir(run_dir: Path, project: str, experiment: str) -> Path:
    """``<run folder>/tensorboard``; with verl's ``TENSORBOARD_DIR`` set,
    ``$TENSORBOARD_DIR/<project>/<experiment>``: one folder a run, so that the runs of one
    coordinator service never mix their curves, side by side under one ``--logdir``."""
    root = os.environ.get("TENSORBOARD_DIR")
    if not root:
        return Path(run_dir) / "tensorboard"
    return Path(root).absolute() / project / experiment


def file_sinks(cfg: RunConfig, run_dir: Path) -> list[MetricsSink]:
    """The sinks of ``trainer.logger`` that write files in (or for) the run folder (a wandb
    run records the resolved config as well)."""
    trainer = cfg.trainer
    name, project = trainer.experiment_name, trainer.project_name
    makers = {
        "jsonl": lambda: JsonlSink(Path(run_dir) / "metrics.jsonl"),
        "tensorboard": lambda: TensorBoardSink(tensorboard_dir(run_dir, project, name)),
        "wandb": lambda: WandbSink(project, name, cfg.model_dump(mode="json"), Path(run_dir)),
        "mlflow": lambda: MlflowSink(project, name, cfg.model_dump(mode="json"), Path(run_dir)),
    }
    sinks: list[MetricsSink] = []
    try:
        for logger, make in makers.items():
            if logger in trainer.logger:
                sinks.append(_start(logger, make))
    except BaseException as e:
        close_sinks(sinks, ended_exit_code(e, finished=False))  # those made before this one
        raise
    return sinks


_REFUSED_BY_MLFLOW = {"INVALID_PARAMETER_VALUE", "PERMISSION_DENIED", "UNAUTHENTICATED"}


def _start(logger: str, make):
    """``make()``. A refusal of the run's settings (no wandb API key, a tracking server
    that refuses the request or the credentials, a missing package) becomes a ConfigError
    naming the logger: the request is wrong (exit 2). Anything else (a server that does not
    answer, a full disk) stays what it is: a failure of the run (exit 1). Either way no
    role server has started yet."""
    try:
        return make()
    except Exception as e:
        if not _is_refusal(e):
            raise
        from meshrl.config import ConfigError

        raise ConfigError(
            f"trainer.logger includes {logger}, but it could not start: {type(e).__name__}: {e}"
        ) from e


def _is_refusal(e: Exception) -> bool:
    """Whether a logger's start-up error says the run's settings are refused."""
    if isinstance(e, ImportError):
        return True
    kind = type(e)
    if kind.__module__.startswith("wandb") and kind.__name__ in (
        "UsageError",
        "AuthenticationError",
    ):
        return True
    refused = getattr(e, "error_code", "") in _REFUSED_BY_MLFLOW
    return kind.__name__ == "MlflowException" and refused


def close_sinks(sinks: list[MetricsSink], exit_code: int) -> None:
    """Closes each sink, telling those that record it how the run ended (``exit_code``, from
    ``ended_exit_code``); one that fails to close does not keep the others open."""
    for sink in sinks:
        try:
            finish = getattr(sink, "finish", None)
            if finish is not None:
                finish(exit_code)
            else:
                sink.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort, each on its own
            log.warning("could not close the metrics sink %s: %s", type(sink).__name__, e)


class ConsoleSink:
    """A short line per step with the numbers one watches; validation lines in full."""

    def __init__(self, write=print):
        self.write = write

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"{short}={metrics[key]:.4g}" for key, short in CONSOLE_KEYS if key in metrics]
        parts += [f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("val-core/")]
        self.write(f"step {step}: " + " ".join(parts))

    def close(self) -> None:
        pass


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
