"""`meshrl run CONFIG` on this machine: start the role servers (local subprocesses, or Ray
actors / external servers by `launcher.kind`), run PPO, stop everything.

Ctrl-C or SIGTERM once: the current step finishes, a checkpoint is saved, every process
stops. A second signal abandons the step at once (the role servers are still stopped).
Before the first step (the data read, the servers starting or loading their models), the
first signal stops the start at once: nothing trained, nothing to save (exit 3).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from meshrl.config import RunConfig
from meshrl.config.rules import check_config
from meshrl.launcher.factory import make_launcher
from meshrl.rpc.security import SecuritySettings
from meshrl_app.graceful_stop import GracefulStop
from services.coordinator.run.lifecycle import run_lifecycle, start_line
from services.coordinator.run.preflight import (
    check_cuda_here,
    check_run_config,
    unused_gpu_warning,
)
from services.coordinator.run.run import PPORun, run_sinks
from services.coordinator.run.run_data import load_run_data

log = logging.getLogger(__name__)


class RunResult(dict):
    """The last step's metrics (a dict, as before), and whether every step ran: False when
    a stop (Ctrl-C, SIGTERM) ended the run early, after its checkpoint. ``note``: why no
    step ran, when none did; ``step`` / ``total_steps``: where it ended, of how many."""

    def __init__(
        self,
        metrics: dict[str, float],
        finished: bool,
        note: str = "",
        step: int = 0,
        total_steps: int = 0,
    ):
        super().__init__(metrics)
        self.finished = finished
        self.note = note
        self.step = step
        self.total_steps = total_steps


class _LocalObserver:
    """Progress to this process's log; Ctrl-C / SIGTERM handed to ``stop``."""

    def __init__(self, stop: GracefulStop, cfg: RunConfig) -> None:
        self.stop = stop
        self.cfg = cfg

    def progress(self, line: str) -> None:
        log.info("%s", line)

    def stop_requested(self) -> bool:
        return False  # a stop comes as a signal, which GracefulStop hands to the run

    def created(self, ppo: PPORun) -> None:
        pass  # a signal still stops the start at once: the models load

    def started(self, ppo: PPORun) -> None:
        self.stop.trains(ppo)
        log.info("%s", start_line(self.cfg, ppo))


def run_local(cfg: RunConfig, stop: GracefulStop | None = None) -> RunResult:
    """Runs the whole PPO job; returns the last step's metrics and whether it finished.
    Raises :class:`~services.coordinator.types.StoppedBeforeStart` for a Ctrl-C or SIGTERM
    before the first step. ``stop``: the signal handling a caller installed earlier (the
    CLI, before its imports); None installs it here."""
    if stop is not None:
        return _run_local(cfg, stop)
    with GracefulStop() as own:
        return _run_local(cfg, own)


def _run_local(cfg: RunConfig, stop: GracefulStop) -> RunResult:
    # This process's own clients (and health probes) use the run's TLS / token settings
    # (config values over the environment's), checked now: a bad path fails here, named.
    os.environ.update(SecuritySettings.from_config(cfg.security).to_env())
    SecuritySettings.from_env().verify()
    check_run_config(cfg)  # before any role server starts
    check_config(cfg, "required")  # after the checks of this machine
    check_cuda_here(cfg)
    if cfg.launcher.kind == "local" and cfg.trainer.device == "cpu":  # servers run here
        if warning := unused_gpu_warning(cfg, torch.cuda.device_count()):
            log.warning("%s", warning)
    run_dir = Path(cfg.trainer.default_local_dir)
    outcome = run_lifecycle(
        cfg,
        run_dir,
        lambda: make_launcher(cfg, run_dir),  # local unless launcher.kind says so
        load_data=load_run_data,
        # a logger that cannot start (wandb online without an API key, an MLflow
        # server that does not answer) ends the run before the models load
        make_sinks=lambda: run_sinks(cfg, run_dir),
        make_ppo=lambda c, e, d, sinks, r: PPORun(c, e, d, sinks=sinks, restarter=r),
        observer=_LocalObserver(stop, cfg),
    )
    # a note (a finished run run again: nothing to do) is said once, by the caller's last
    # line (`meshrl run`: meshrl_app/run_summary.py)
    o = outcome
    return RunResult(o.metrics, o.finished, o.note, o.step, o.total_steps)
