"""SIGTERM during a run: the current step finishes, a checkpoint is saved, every process stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import CheckpointManager, verify

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_sigterm_checkpoints_and_stops_everything(tiny_model, arithmetic_data, tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({}))
    cmd = [
        sys.executable,
        "-m",
        "meshrl_app.cli",
        "run",
        str(config),
        f"data.train_files=[{arithmetic_data['train']}]",
        "data.train_batch_size=8",
        "data.max_response_length=10",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "trainer.total_training_steps=500",
        "trainer.plot=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (metrics.exists() and read_jsonl(metrics)):
        time.sleep(0.2)
    servers = psutil.Process(proc.pid).children(recursive=True)
    assert servers, "role servers were running"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-2000:]  # stopped, as `meshrl run --coordinator` says
    steps = [r["step"] for r in read_jsonl(metrics)]
    final = CheckpointManager(run_dir).latest_valid()
    assert final is not None and final.name == f"global_step_{steps[-1]}", (
        "checkpoint of the last step"
    )
    verify(final)
    assert steps[-1] < 500
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"processes left behind: {alive}"
