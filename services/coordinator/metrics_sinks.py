"""Where step metrics go: the console (one line per step), a JSONL file, TensorBoard,
Weights & Biases."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Protocol

from meshrl.config.schema import RunConfig
from services.coordinator.run_types import ended_exit_code

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
    the others need not know."""

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

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # One call a step, committed at once: a crash must not take the last step with it.
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        self.run.log({**finite, self.STEP: step})

    def finish(self, exit_code: int) -> None:
        """Ends the run, recording how: 0 marks it finished, any other code failed
        (``ended_exit_code`` says which code each end gets)."""
        self.run.finish(exit_code=exit_code)

    def close(self) -> None:
        # Closed without a word on how the run ended: finished, as wandb's own default.
        # The coordinator closes its sinks through close_sinks, which says.
        self.finish(0)


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
    sinks: list[MetricsSink] = []
    try:
        if "jsonl" in trainer.logger:
            sinks.append(JsonlSink(Path(run_dir) / "metrics.jsonl"))
        if "tensorboard" in trainer.logger:
            where = tensorboard_dir(run_dir, trainer.project_name, trainer.experiment_name)
            sinks.append(TensorBoardSink(where))
        if "wandb" in trainer.logger:
            name, project = trainer.experiment_name, trainer.project_name
            config = cfg.model_dump(mode="json")
            sinks.append(WandbSink(project, name, config, Path(run_dir)))
    except BaseException as e:
        close_sinks(sinks, ended_exit_code(e, finished=False))  # those made before this one
        raise
    return sinks


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
