"""Two `meshrl run` processes on one run folder: the second is refused while the first
runs, in one line with exit 2, and the folder is free again once the first is killed with
SIGKILL. Before, the second resumed from the first's checkpoint while the first trained on,
and both appended to one metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import write_arithmetic_parquet
from services.coordinator.run.run_folder_lock import LOCK_FILE

pytestmark = pytest.mark.slow


def _wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _holder(run_dir) -> dict | None:
    try:
        return json.loads((run_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def test_a_second_run_in_a_folder_in_use_is_refused_and_a_killed_holder_frees_it(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model", hidden=32, intermediate=64)
    data = write_arithmetic_parquet(tmp_path / "data", n_train=16, n_val=8)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "meshrl_app.cli", "run",
        f"data.train_files={data['train']}", f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
        "trainer.total_training_steps=1000", "trainer.logger=[jsonl]", "trainer.plot=false",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    first = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        holder = _wait_for(lambda: _holder(run_dir), "the first run to hold its folder")
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()

        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.splitlines() == [
            f"meshrl: trainer.default_local_dir: the run folder {run_dir} is in use by another "
            f"run (pid {first.pid} on host {socket.gethostname()}, since {holder['since']}); "
            "wait for it to end or stop it, or give this run another "
            "trainer.default_local_dir"
        ]
        assert first.poll() is None, "the first run goes on"
        servers = psutil.Process(first.pid).children(recursive=True)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as the OOM killer would: no clean-up runs
        first.wait()
    try:
        # The lock went with the process. A third run gets past it at once: it stops at
        # its next check, a missing data file (read right after the folder is taken).
        third = subprocess.run(
            [*cmd, f"data.train_files={tmp_path / 'missing.parquet'}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert third.returncode == 2
        assert "reading the tokenizer and the data" in third.stderr  # past the lock
        assert third.stderr.splitlines()[-1] == (
            f"meshrl: data file {tmp_path / 'missing.parquet'} does not exist"
        )
    finally:
        for server in servers:  # they would stop by themselves within 30 s
            try:
                server.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(servers, timeout=10)
