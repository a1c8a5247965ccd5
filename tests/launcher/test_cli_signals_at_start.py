"""Ctrl-C or SIGTERM to `meshrl run` while it starts: exit 3 (a stop) and one line, every
role server stopped, no traceback. Before, a Ctrl-C exited 130 (the code of a second Ctrl-C)
with a KeyboardInterrupt traceback from the fork server's imports, and a SIGTERM killed the
command without a word (exit -15), its servers left to notice by themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from meshrl.rpc.call_markers import TEST_SLOW_ENV
from meshrl.testing.processes import without_exit_warnings
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import write_arithmetic_parquet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    model = make_tiny_model_dir(root / "tiny", seed=0, hidden=32, intermediate=64)
    data = write_arithmetic_parquet(root / "data", n_train=16, n_val=4)
    return [
        sys.executable, "-m", "meshrl_app.cli", "run",
        f"data.train_files={data['train']}", f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4", "data.max_prompt_length=16",
        "data.max_response_length=4", "trainer.total_training_steps=2",
        "trainer.logger=[console]",
    ]  # fmt: skip


def _signal_when(command, run_dir: Path, line: str, sig: int, env: dict) -> tuple[int, str]:
    """Starts `meshrl run` in a session of its own, sends `sig` to that whole group (as a
    terminal's Ctrl-C reaches the fork server too) once its stderr has `line`; returns the
    exit code and stderr."""
    err_path = run_dir.parent / f"{run_dir.name}.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [*command, f"trainer.default_local_dir={run_dir}"],
            stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while line not in err_path.read_text(errors="replace"):
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"never said {line!r}"
            time.sleep(0.05)
        servers = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, sig)
        code = proc.wait(timeout=60)
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"left running: {alive}"
    return code, err_path.read_text(errors="replace")


def test_ctrl_c_while_the_models_load_is_a_stop(command, tmp_path):
    # the actor's Initialize held: the signal surely lands while the models load
    env = {**os.environ, TEST_SLOW_ENV: "actor.Initialize=60"}
    code, err = _signal_when(
        command, tmp_path / "run", "initializing role servers (models load now)", signal.SIGINT, env
    )
    assert code == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert without_exit_warnings(err).endswith(
        "meshrl: stopped by SIGINT while the run started (before its first step); every role "
        "server stopped, nothing trained"
    ), err[-2000:]


def test_sigterm_while_the_servers_start_is_a_stop(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != TEST_SLOW_ENV}
    code, err = _signal_when(
        command, tmp_path / "run", "starting role servers (local launcher)", signal.SIGTERM, env
    )
    assert code == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "meshrl: stopped by SIGTERM while the run started (before its first step)" in err


def test_a_second_ctrl_c_abandons_the_step_with_130(command, tmp_path):
    """Once the run trains: the first Ctrl-C asks it to finish its step (held here, so it
    cannot), the second abandons the step: exit 130, the one code a second Ctrl-C has."""
    env = {**os.environ, TEST_SLOW_ENV: "actor.UpdatePolicy=60@1"}
    run_dir = tmp_path / "run"
    err_path = tmp_path / "run.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [*command, f"trainer.default_local_dir={run_dir}"],
            stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True,
        )  # fmt: skip
        actor_log = run_dir / "logs" / "actor.log"
        deadline = time.monotonic() + 240
        while "rpc UpdatePolicy #1 started" not in (
            actor_log.read_text(errors="replace") if actor_log.exists() else ""
        ):
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "step 1 never reached its update"
            time.sleep(0.05)
        servers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        text = ""
        while "finishing the current step" not in text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            text = err_path.read_text(errors="replace")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"left running: {alive}"
    err = err_path.read_text(errors="replace")
    assert code == 130, err[-3000:]
    assert without_exit_warnings(err).endswith("meshrl: interrupted; all role servers stopped"), (
        err[-2000:]
    )
