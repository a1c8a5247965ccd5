"""The external launcher checks that each address serves its role's service, against a real
reward server process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.config import ConfigError, build_config
from meshrl.launcher.external import ExternalLauncher
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health
from services.reward.server import SERVICE_NAME

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reward_address(tmp_path_factory):
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("reward") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward.server", "--port", address.split(":")[1],
             "--num-workers", "1"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_health(address, SERVICE_NAME, 90, alive=lambda: proc.poll() is None)
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def _launcher(rollout: str, actor: str, reward: str) -> ExternalLauncher:
    cfg = build_config(
        {},
        [
            "algorithm.adv_estimator=grpo",
            "launcher.kind=external",
            f"launcher.addresses.rollout=[{rollout}]",
            f"launcher.addresses.actor=[{actor}]",
            f"launcher.addresses.reward=[{reward}]",
        ],
    )
    return ExternalLauncher(cfg)


def test_a_reward_server_given_as_the_actor_is_refused_naming_the_key(reward_address):
    """Before, the run failed at its first call: `actor at ... failed during Initialize:
    UNIMPLEMENTED: Method not found!`, exit 1."""
    launcher = _launcher(rollout=reward_address, actor=reward_address, reward=reward_address)
    with pytest.raises(ConfigError) as e:
        launcher.start()
    assert str(e.value) == (
        f"launcher.addresses.rollout: {reward_address} is a reward server, not the rollout "
        "role's (meshrl.api.v1.RolloutService); are two addresses swapped?"
    )


def test_the_actor_role_is_checked_for_the_trainer_service(reward_address):
    from meshrl.launcher.external import _check_serves

    with pytest.raises(ConfigError) as e:
        _check_serves("actor", reward_address)
    assert str(e.value) == (
        f"launcher.addresses.actor: {reward_address} is a reward server, not the actor role's "
        "(meshrl.api.v1.TrainerService); are two addresses swapped?"
    )
    _check_serves("reward", reward_address)  # its own role: no error


@pytest.fixture(scope="module")
def critic_address(tmp_path_factory):
    """A trainer server started with --role critic (no model: GetInfo answers before any
    Initialize)."""
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("critic") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.trainer.server", "--role", "critic",
             "--port", address.split(":")[1]],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    try:
        wait_for_health(address, "", 90, alive=lambda: proc.poll() is None)
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_critic_given_as_the_actor_is_refused_naming_the_key(critic_address):
    """Both serve the trainer service, so the service check passed them: the run loaded
    both models, then failed at its first call only the actor serves."""
    from meshrl.launcher.external import _check_serves

    with pytest.raises(ConfigError) as e:
        _check_serves("actor", critic_address)
    assert str(e.value) == (
        f"launcher.addresses.actor: {critic_address} is the critic role's trainer server "
        "(started with --role critic), not the actor role's; are two addresses swapped?"
    )
    _check_serves("critic", critic_address)  # its own role: no error


def test_recovery_says_the_external_launcher_waits_rather_than_restarts():
    """Before, the log said `role servers down: actor; restarting them`, then was silent
    for the whole start-up timeout, though nothing here restarts an external server."""
    from services.coordinator.recovery import RESTARTING, recovery_plan

    external = _launcher("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert recovery_plan(external).startswith("waiting up to 120 s for them to answer again")
    assert recovery_plan(object()) == RESTARTING
