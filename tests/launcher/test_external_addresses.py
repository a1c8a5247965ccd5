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


def _serving(log_dir: Path, module: str, *args: str, service: str = ""):
    """A role server process (``python -m module --port P *args``) on a free port; yields
    its address once its health service answers for ``service``."""
    address = f"127.0.0.1:{free_port()}"
    with open(log_dir / "server.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", address.split(":")[1], *args],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    try:
        wait_for_health(address, service, 90, alive=lambda: proc.poll() is None)
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def reward_address(tmp_path_factory):
    yield from _serving(
        tmp_path_factory.mktemp("reward"), "services.reward.server", "--num-workers", "1",
        service=SERVICE_NAME,
    )  # fmt: skip


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


@pytest.fixture(scope="module")
def critic_address(tmp_path_factory):
    """A trainer server started with --role critic (no model: GetInfo answers before any
    Initialize)."""
    yield from _serving(
        tmp_path_factory.mktemp("critic"), "services.trainer.server", "--role", "critic"
    )


@pytest.mark.parametrize(
    ("server", "own_role", "is_what"),
    [
        # another service at the actor's address
        ("reward_address", "reward", "a reward server, not the actor role's "
         "(meshrl.api.v1.TrainerService)"),
        # the same service, another role: before, the run loaded both models, then failed at
        # its first call only the actor serves
        ("critic_address", "critic", "the critic role's trainer server (started with --role "
         "critic), not the actor role's"),
    ],
    ids=["reward", "critic"],
)  # fmt: skip
def test_the_actor_address_is_checked_for_the_actors_service_and_role(
    request, server, own_role, is_what
):
    from meshrl.launcher.external import _check_serves

    address = request.getfixturevalue(server)
    with pytest.raises(ConfigError) as e:
        _check_serves("actor", address)
    assert str(e.value) == (
        f"launcher.addresses.actor: {address} is {is_what}; are two addresses swapped?"
    )
    _check_serves(own_role, address)  # its own role: no error


def test_recovery_says_the_external_launcher_waits_rather_than_restarts():
    """Before, the log said `role servers down: actor; restarting them`, then was silent
    for the whole start-up timeout, though nothing here restarts an external server."""
    from services.coordinator.recovery import RESTARTING, recovery_plan

    external = _launcher("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert recovery_plan(external).startswith("waiting up to 120 s for them to answer again")
    assert recovery_plan(object()) == RESTARTING
