"""Helpers of the coordinator-service tests: real server processes on free loopback ports
(always killed by `stop()`), and a tiny run config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m MODULE --host 127.0.0.1 --port P ...` in its own process group."""

    def __init__(self, module: str, log_path: Path, *args: str, cwd: Path = REPO, port: int = 0):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    *args,
                ],
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            )
        try:
            wait_for_health(self.address, "", 90, alive=lambda: self.proc.poll() is None)
        except Exception:
            self.stop()
            raise RuntimeError(f"{module} did not start:\n{log_path.read_text()}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM to the whole group (the server and anything it launched), then SIGKILL."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        self.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def tiny_run_yaml(model: Path, data: dict, run_dir: Path, steps: int) -> str:
    """A GRPO run (no critic, no ref: three role servers) on the tiny model."""
    return f"""
data:
  train_files: [{data["train"]}]
  train_batch_size: 8
  max_prompt_length: 16
  max_response_length: 8
actor_rollout_ref:
  model: {{path: {model}}}
  actor: {{ppo_mini_batch_size: 8, ppo_micro_batch_size_per_gpu: 8}}
  rollout: {{n: 2}}
algorithm: {{adv_estimator: grpo}}
reward: {{num_workers: 1}}
trainer:
  total_training_steps: {steps}
  plot: false
  default_local_dir: {run_dir}
"""
