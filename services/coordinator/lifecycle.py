"""One run's life, from its folder to its servers' stop: the same for `meshrl run` on this
machine (``meshrl_app/run_local.py``) and for a run of the coordinator service
(``run_manager.py``), which differ only in how they report progress and ask to stop.

    folder (locked for the run) -> hub models fetched -> data (a finished run ends here) -> config file -> sinks -> role servers up
           -> PPORun -> set-up -> train -> close (the sinks learn how it ended) -> servers down

The order is the user's protection: a bad data file, a model path or a logger that cannot
start ends the run before any role server starts (and before models load); a failure once
they are up still closes the sinks (a wandb run is marked failed) and stops the servers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from meshrl.config import RunConfig
from meshrl.hub_models import with_local_models
from services.coordinator.metrics_sinks import MetricsSink, close_sinks
from services.coordinator.preflight import start_run_folder, write_run_config
from services.coordinator.run_folder_lock import RunFolderLock
from services.coordinator.types import AlreadyTrained, ended_exit_code


class RunObserver(Protocol):
    """How the caller hears of the run's progress and says it should stop."""

    def progress(self, line: str) -> None:
        """A line of what the run is doing now (reading data, starting servers, ...)."""

    def stop_requested(self) -> bool:
        """True once the caller wants the run to end after its current step."""

    def created(self, ppo) -> None:
        """The run's PPORun exists (its servers are up); it can be told to stop from now."""

    def started(self, ppo) -> None:
        """The run is set up and about to train (its models loaded)."""


@dataclass(frozen=True)
class RunOutcome:
    metrics: dict[str, float]
    """The last step's metrics (empty when no step ran)."""
    finished: bool
    """Every step ran (False: stopped early, after its checkpoint)."""
    note: str = ""
    """Why no step ran, when none did (a finished run run again, a stop before the start)."""


def run_lifecycle(
    cfg: RunConfig,
    run_dir: Path,
    make_launcher: Callable,
    *,
    load_data: Callable,
    make_sinks: Callable[[], list[MetricsSink]],
    make_ppo: Callable,
    observer: RunObserver,
) -> RunOutcome:
    """Runs the job once its config has passed the preflight checks. ``make_launcher()``
    is called once the data is read; its launcher is stopped on the way out, whatever
    happened. The run folder is held for the whole run: another run there is refused
    (RunFolderInUse)."""
    start_run_folder(run_dir, cfg)
    with RunFolderLock(run_dir):
        return _run_in_folder(
            cfg,
            run_dir,
            make_launcher,
            load_data=load_data,
            make_sinks=make_sinks,
            make_ppo=make_ppo,
            observer=observer,
        )


def _run_in_folder(
    cfg: RunConfig,
    run_dir: Path,
    make_launcher: Callable,
    *,
    load_data: Callable,
    make_sinks: Callable[[], list[MetricsSink]],
    make_ppo: Callable,
    observer: RunObserver,
) -> RunOutcome:
    # A hub id among the model keys is fetched once, here: every role server gets the
    # folder of its snapshot and reads no network.
    cfg = with_local_models(cfg, say=observer.progress)
    observer.progress("reading the tokenizer and the data")
    try:
        data = load_data(cfg, run_dir)
    except AlreadyTrained as done:  # a finished run run again: no server starts
        return RunOutcome({}, finished=True, note=str(done))
    write_run_config(run_dir, cfg)
    sinks = make_sinks()
    try:
        launcher = make_launcher()
    except BaseException as e:
        close_sinks(sinks, ended_exit_code(e, finished=False))
        raise
    try:
        kind = cfg.launcher.kind
        # an external launcher starts nothing: it checks the servers named in the config
        doing = "connecting to the role servers" if kind == "external" else "starting role servers"
        observer.progress(f"{doing} ({kind} launcher)")
        try:
            endpoints = launcher.start()
            observer.progress(f"role servers up: {endpoints}")
            if observer.stop_requested():
                close_sinks(sinks, ended_exit_code(None, finished=False))
                return RunOutcome({}, finished=False, note="stopped before the first step")
            restarter = launcher if hasattr(launcher, "dead_roles") else None
            ppo = make_ppo(cfg, endpoints, run_dir, sinks, restarter)
            observer.created(ppo)
        except BaseException as e:
            # the files, and a wandb run (marked failed), that no run will close
            close_sinks(sinks, ended_exit_code(e, finished=False))
            raise
        try:
            observer.progress("initializing role servers (models load now)")
            ppo.setup(data)
            if observer.stop_requested():
                ppo.stop()
            observer.started(ppo)
            metrics = ppo.train()
        except BaseException as e:
            ppo.close(error=e)  # its sinks record the failure: a wandb run is failed
            raise
        ppo.close()  # finished, or stopped: its sinks tell them apart
        return RunOutcome(metrics, finished=ppo.finished)
    finally:
        launcher.stop()
