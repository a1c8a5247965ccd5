"""`meshrl run CONFIG` on this machine: start the role servers (local subprocesses, or Ray
actors / external servers by `launcher.kind`), run PPO, stop everything.

Ctrl-C or SIGTERM once: the current step finishes, a checkpoint is saved, every process
stops. A second signal abandons the step at once (the role servers are still stopped).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from meshrl.config import RunConfig
from meshrl.launcher.factory import make_launcher
from meshrl.rpc.security import SecuritySettings
from services.coordinator.lifecycle import run_lifecycle, start_line
from services.coordinator.preflight import (
    check_cuda_here,
    check_required_keys_given,
    check_run_config,
    unused_gpu_warning,
)
from services.coordinator.run import PPORun, run_sinks
from services.coordinator.run_data import load_run_data

log = logging.getLogger(__name__)


class GracefulStop:
    """First SIGINT/SIGTERM asks the run to stop after its step; the second interrupts."""

    def __init__(self, run: PPORun):
        self.run = run
        self.signals = 0
        self.previous: dict[int, Any] = {}  # what signal.signal gave back

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            log.warning(
                "signal %d: finishing the current step, then checkpoint and stop "
                "(again to abandon it)",
                signum,
            )
            self.run.stop()
        else:
            raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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
    """Progress to this process's log; Ctrl-C / SIGTERM handled once the run exists (until
    ``handlers`` closes)."""

    def __init__(self, handlers: ExitStack, cfg: RunConfig) -> None:
        self.handlers = handlers
        self.cfg = cfg

    def progress(self, line: str) -> None:
        log.info("%s", line)

    def stop_requested(self) -> bool:
        return False  # a stop comes as a signal, which GracefulStop hands to the run

    def created(self, ppo: PPORun) -> None:
        self.handlers.enter_context(GracefulStop(ppo))

    def started(self, ppo: PPORun) -> None:
        log.info("%s", start_line(self.cfg, ppo))


def run_local(cfg: RunConfig) -> RunResult:
    """Runs the whole PPO job; returns the last step's metrics and whether it finished."""
    # This process's own clients (and health probes) use the run's TLS / token settings
    # (config values over the environment's), checked now: a bad path fails here, named.
    os.environ.update(SecuritySettings.from_config(cfg.security).to_env())
    SecuritySettings.from_env().verify()
    check_run_config(cfg)  # before any role server starts
    check_required_keys_given(cfg)
    check_cuda_here(cfg)
    if cfg.launcher.kind == "local" and cfg.trainer.device == "cpu":  # servers run here
        if warning := unused_gpu_warning(cfg, torch.cuda.device_count()):
            log.warning("%s", warning)
    run_dir = Path(cfg.trainer.default_local_dir)
    with ExitStack() as handlers:
        outcome = run_lifecycle(
            cfg,
            run_dir,
            lambda: make_launcher(cfg, run_dir),  # local unless launcher.kind says so
            load_data=load_run_data,
            # a logger that cannot start (wandb online without an API key, an MLflow
            # server that does not answer) ends the run before the models load
            make_sinks=lambda: run_sinks(cfg, run_dir),
            make_ppo=lambda c, e, d, sinks, r: PPORun(c, e, d, sinks=sinks, restarter=r),
            observer=_LocalObserver(handlers, cfg),
        )
    # a note (a finished run run again: nothing to do) is said once, by the caller's last
    # line (`meshrl run`: meshrl_app/run_summary.py)
    o = outcome
    return RunResult(o.metrics, o.finished, o.note, o.step, o.total_steps)
