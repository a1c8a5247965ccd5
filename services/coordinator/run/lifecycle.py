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

from meshrl import progress_ticker
from meshrl.config import RunConfig
from meshrl.hub_models import with_local_models
from meshrl.progress_ticker import ProgressTicker
from meshrl.rpc.calls_in_flight import CALLS_IN_FLIGHT
from services.coordinator.metrics.sinks import MetricsSink, close_sinks
from services.coordinator.run.preflight import check_gpu_memory, start_run_folder, write_run_config
from services.coordinator.run.run_folder_lock import RunFolderLock
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
    step: int = 0
    """The step the run ended at (a finished run run again: its checkpoint's)."""
    total_steps: int = 0
    """The steps the run has in all (0 when unknown, and in an evaluation)."""


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
    check_gpu_memory(cfg, observer.progress)  # the model's shape is readable from here on
    observer.progress("reading the tokenizer and the data")
    try:
        data = load_data(cfg, run_dir)
    except AlreadyTrained as done:  # a finished run run again: no server starts
        return RunOutcome({}, True, str(done), done.step, done.total_steps)
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
            with long_calls_said(ppo, observer.progress):
                ppo.setup(data)
                if observer.stop_requested():
                    ppo.stop()
                observer.started(ppo)
                metrics = ppo.train()
        except BaseException as e:
            ppo.close(error=e)  # its sinks record the failure: a wandb run is failed
            raise
        ppo.close()  # finished, or stopped: its sinks tell them apart
        return RunOutcome(metrics, ppo.finished, "", ppo.progress.step, ppo.total_steps)
    finally:
        launcher.stop()


def long_calls_said(ppo, say: Callable[[str], None]) -> ProgressTicker:
    """While the run sets up and trains, ``say`` names every PROGRESS_EVERY_S the calls to
    its role servers still under way ("still waiting: actor Initialize (10 s)"): loading
    models, the first weight sync, step 1's generation were silent gaps of 7 to 18 s on a
    loaded machine. Only this run's servers: a coordinator service runs several runs."""

    def line(elapsed_s: float) -> str | None:
        servers = getattr(ppo, "servers", None)  # a PPORun's RoleServers
        endpoints = getattr(servers, "endpoints", None)  # moves when a server is restarted
        addresses = None if endpoints is None else endpoint_addresses(endpoints)
        return CALLS_IN_FLIGHT.long_calls_line(progress_ticker.PROGRESS_EVERY_S, addresses)

    # polled often: each call is said at its own marks (10 s, 20 s, ... after it started)
    return ProgressTicker(line, say, every_s=min(1.0, progress_ticker.PROGRESS_EVERY_S / 4))


def endpoint_addresses(endpoints) -> set[str]:
    """host:port of every role server in ``endpoints`` (an Endpoints)."""
    named = [endpoints.actor, endpoints.reward, endpoints.critic, endpoints.ref, endpoints.env]
    return {*endpoints.rollout, *(a for a in named if a)}


def start_line(cfg: RunConfig, ppo) -> str:
    """What a run set up is about to do: "running 10 PPO steps", "resumed from
    .../global_step_8 (step 8); running 2 of 10 PPO steps", or an evaluation's."""
    step, total = ppo.progress.step, ppo.total_steps
    if cfg.trainer.val_only:
        return f"validating the weights of step {step} (trainer.val_only)"
    plural = "s" if total != 1 else ""
    resumed = ppo.checkpoints.resumed_from
    if resumed is None:
        return f"running {total} PPO step{plural}"
    return (
        f"resumed from {resumed} (step {step}); running {total - step} of {total} PPO step{plural}"
    )
