"""`meshrl run CONFIG` with the local launcher: start servers, run PPO, stop everything."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from meshrl.config import RunConfig, config_to_yaml
from meshrl.launcher.local import LocalLauncher
from services.coordinator.run import PPORun

log = logging.getLogger(__name__)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_local(cfg: RunConfig) -> dict[str, float]:
    """Runs the whole PPO job on this machine; returns the last step's metrics."""
    run_dir = Path(cfg.trainer.default_local_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM tidies up like Ctrl-C
    try:
        with LocalLauncher(cfg, run_dir) as launcher:
            endpoints = launcher.start()
            log.info("role servers up: %s", endpoints)
            run = PPORun(cfg, endpoints, run_dir)
            try:
                run.setup()
                return run.train()
            finally:
                run.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
