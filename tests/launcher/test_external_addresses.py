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
    from services.coordinator.recovery.recovery import RESTARTING, recovery_plan

    external = _launcher("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert recovery_plan(external).startswith("waiting up to 120 s for them to answer again")
    assert recovery_plan(object()) == RESTARTING


def test_a_server_that_refuses_connections_is_waited_for_aloud_then_named(monkeypatch, caplog):
    """Before: the whole start-up timeout (120 s) in silence, then `server at H:P not
    healthy after 120s (UNAVAILABLE: failed to connect to all addresses; ...)`."""
    from meshrl import progress_ticker
    from meshrl.rpc.client import ServiceUnavailable

    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 0.5)  # 10 s in a run
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens: connections are refused
    launcher = _launcher(nobody, nobody, nobody)
    launcher.cfg.launcher.startup_timeout_s = 2.0
    with caplog.at_level("INFO", logger="meshrl.launcher.external"):
        with pytest.raises(ServiceUnavailable) as e:
            launcher.start()
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
    assert len(waits) >= 2, "a line every PROGRESS_EVERY_S while it waits"
    assert waits[0].startswith(f"waiting for rollout0 at {nobody} (connection refused) ... ")
    assert waits[0].endswith(" s of 2 s")
    assert str(e.value) == (
        f"rollout0 at {nobody} not healthy after 2s (connection refused); "
        "launcher.kind=external starts no server: start it there, or correct "
        "launcher.addresses.rollout (launcher.startup_timeout_s=2)"
    )


def test_meshrl_run_against_external_servers_that_are_not_up_ends_in_one_line(
    monkeypatch, tmp_path, capsys
):
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app import cli
    from meshrl_app.demo.arithmetic import write_arithmetic_parquet

    model = make_tiny_model_dir(tmp_path / "model")
    train = write_arithmetic_parquet(tmp_path / "data", n_train=8, n_val=4)["train"]
    nobody = f"127.0.0.1:{free_port()}"
    (tmp_path / "run.yaml").write_text("{}\n")
    argv = ["run", str(tmp_path / "run.yaml"), f"actor_rollout_ref.model.path={model}"]
    argv += [f"data.train_files={train}", "algorithm.adv_estimator=grpo", "trainer.logger=console"]
    argv += ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    argv += [f"trainer.default_local_dir={tmp_path / 'run'}", "launcher.kind=external"]
    argv += [f"launcher.addresses.{role}={nobody}" for role in ("rollout", "actor", "reward")]
    argv += ["launcher.startup_timeout_s=1"]
    capsys.readouterr()  # the model's making
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == [
        f"meshrl: rollout0 at {nobody} not healthy after 1s (connection refused); "
        "launcher.kind=external starts no server: start it there, or correct "
        "launcher.addresses.rollout (launcher.startup_timeout_s=1)"
    ]
