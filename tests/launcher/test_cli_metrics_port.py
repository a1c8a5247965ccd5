"""`--metrics-port` of the server commands: a value that is no port, and a port in use, are
one line each and exit 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl_app import cli

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["serve", "rollout"], ["reward", "serve"]])
def test_a_metrics_port_that_is_no_port_is_refused_by_the_parser(command, capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main([*command, "--metrics-port", "99999"])
    assert ended.value.code == 2
    assert (
        "argument --metrics-port: must be a port number 0 to 65535 (0 = any free port), "
        "got '99999'" in capsys.readouterr().err
    )


def test_reward_serve_on_a_metrics_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "meshrl_app.cli", "reward", "serve", "--port", "0"]
            + ["--metrics-port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"meshrl: meshrl.api.v1.RewardService cannot serve metrics on 127.0.0.1:{port}: port "
        f"{port} is already in use (another server, or one left over from an earlier run)"
    )
    assert "Traceback" not in done.stderr
