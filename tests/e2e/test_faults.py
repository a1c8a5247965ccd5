"""Fault injection: kill -9 of each role server in the middle of a run, and of the
coordinator itself. Every run completes its planned steps and ends with a valid checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml

from meshrl.config import build_config
from meshrl.launcher.local import LocalLauncher
from services.coordinator.checkpointing import CheckpointManager, verify
from services.coordinator.metrics_sinks import read_jsonl
from services.coordinator.run import PPORun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 5


def _overrides(tiny_model, data, run_dir):
    return [
        f"data.train_files=[{data['train']}]",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=10",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "algorithm.use_kl_in_reward=true",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2", "trainer.plot=false",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}",
    ]


def _kill(launcher: LocalLauncher, name: str) -> None:
    os.killpg(launcher.processes[name].popen.pid, signal.SIGKILL)


@pytest.mark.parametrize("victim", ["rollout0", "actor", "critic", "ref", "reward"])
def test_role_server_killed_mid_run(victim, tiny_model, arithmetic_data, tmp_path):
    cfg = build_config({}, _overrides(tiny_model, arithmetic_data, tmp_path))
    with LocalLauncher(cfg, tmp_path) as launcher:
        endpoints = launcher.start()
        first_pid = launcher.processes[victim].popen.pid

        def on_step(step, metrics):
            # after step 3's checkpoint-free log line, kill the victim a moment into step 4
            if step == 3 and launcher.processes[victim].popen.pid == first_pid:
                threading.Timer(0.05, _kill, (launcher, victim)).start()

        run = PPORun(cfg, endpoints, tmp_path, on_step=on_step, restarter=launcher)
        try:
            run.setup()
            last = run.train()
        finally:
            run.close()
        assert launcher.processes[victim].popen.pid != first_pid, "the victim was restarted"
    assert last["training/global_step"] == STEPS
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert steps[-1] == STEPS and set(steps) == set(range(1, STEPS + 1))
    if victim in ("actor", "critic"):
        assert steps.count(3) == 2, "training state was lost: the run went back to step 2's checkpoint"
    final = CheckpointManager(tmp_path).latest_valid()
    assert final is not None and final.name == f"global_step_{STEPS}"
    verify(final)


def test_coordinator_killed_then_resumed_from_cli(tiny_model, arithmetic_data, tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({}))
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(config),
           *_overrides(tiny_model, arithmetic_data, run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait for the step-2 checkpoint, then kill everything
        if (run_dir / "checkpoints" / "global_step_2").is_dir():
            break
        time.sleep(0.1)
    else:
        pytest.fail("no checkpoint within 300 s")
    servers = psutil.Process(proc.pid).children(recursive=True)
    assert servers, "the coordinator had started its role servers"
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator (role servers run in own sessions)
    proc.wait()
    # orphaned role servers notice their launcher is gone and stop by themselves
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"role servers left behind: {alive}"

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert rows[-1]["step"] == STEPS
    verify(CheckpointManager(run_dir).latest_valid())
