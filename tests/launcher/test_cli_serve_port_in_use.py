"""Every server command on a port already in use: one line `meshrl: ...`, exit 2.

Before, `meshrl serve rollout|trainer|coordinator` and `python -m services.<role>.server`
printed gRPC's C-core log line (`E1205 ... add_port.cc:83] Failed to add port to server`)
and a Python traceback, exit 1; only `meshrl reward serve` said it in one line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

COMMANDS = {
    "meshrl serve rollout": ([PY, "-m", "meshrl_app.cli", "serve", "rollout"], "rollout server"),
    "meshrl serve trainer": (
        [PY, "-m", "meshrl_app.cli", "serve", "trainer", "--role", "critic"],
        "critic trainer server",
    ),
    "meshrl serve coordinator": (
        [PY, "-m", "meshrl_app.cli", "serve", "coordinator"],
        "coordinator service",
    ),
    "meshrl reward serve": ([PY, "-m", "meshrl_app.cli", "reward", "serve"], "reward server"),
    "python -m services.rollout.server": (
        [PY, "-m", "services.rollout.server"],
        "rollout server",
    ),
    "python -m services.trainer.server": (
        [PY, "-m", "services.trainer.server", "--role", "actor"],
        "actor trainer server",
    ),
    "python -m services.coordinator.server": (
        [PY, "-m", "services.coordinator.server"],
        "coordinator service",
    ),
    "python -m services.reward.server": (
        [PY, "-m", "services.reward.server", "--num-workers", "1"],
        "reward server",
    ),
}


@pytest.fixture
def taken_port():
    with socket.socket() as holder:  # another server, listening
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_server_on_a_port_in_use_says_so_in_one_line_and_exits_2(tmp_path, taken_port, command):
    argv, name = COMMANDS[command]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*argv, "--port", str(taken_port)],
        cwd=tmp_path,  # the coordinator service's run folders would go here
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"meshrl: {name} cannot bind 127.0.0.1:{taken_port}: port {taken_port} is already "
        "in use (another server, or one left over from an earlier run)"
    ], "one line: no traceback, no gRPC C-core log line"
