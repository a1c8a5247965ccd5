"""`meshrl rollout add|remove` through the coordinator service: the run's pool membership is
asked to change at its next step boundary, and a change that cannot be made is refused
saying why. The service runs in this process over a stand-in run: no role server starts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_coordinator_shutdown import RUN_YAML, FakePPO, serve

from meshrl_app import cli
from meshrl_app.remote import rollout
from services.coordinator.client import CoordinatorClient
from services.coordinator.recovery.pool_membership import PoolMembership
from services.coordinator.roles.roles import Roles

REPLICA = "127.0.0.1:7001"
LIVE = {REPLICA, "127.0.0.1:7002", "127.0.0.1:7003"}  # where a stand-in server answers


class PoolPPO(FakePPO):
    """A run with one rollout replica, at REPLICA, and the run's real membership logic."""

    def __init__(self, cfg, endpoints, run_dir, sinks, restarter):
        super().__init__(cfg, endpoints, run_dir, sinks, restarter)
        roles = Roles(rollouts=[SimpleNamespace(address=REPLICA)], actor=None, reward=None)
        servers = SimpleNamespace(roles=roles)
        self.membership = PoolMembership(
            cfg, servers, None, lambda version: None, probe=lambda address: address not in LIVE
        )


@pytest.fixture
def running(tmp_path):
    server, _, manager = serve(tmp_path, PoolPPO)
    address = f"127.0.0.1:{server.port}"
    client = CoordinatorClient(address)
    run_id = client.start_run(RUN_YAML, []).run_id
    deadline = time.monotonic() + 30
    while manager.status(run_id).state.name != "RUNNING":
        assert time.monotonic() < deadline, "the stand-in run never ran"
        time.sleep(0.02)
    yield address, run_id, manager._get(run_id).ppo
    client.stop_run(run_id)
    client.close()
    server.stop(0)


def test_add_and_remove_are_asked_of_the_runs_pool(running):
    address, run_id, ppo = running
    lines: list[str] = []
    assert rollout(address, "add", "127.0.0.1:7002", run_id, write=lines.append) == 0
    assert "joins run" in lines[-1] and "next step boundary" in lines[-1]
    assert ppo.membership._adds == ["127.0.0.1:7002"]
    assert rollout(address, "remove", REPLICA, run_id, write=lines.append) == 0
    assert ppo.membership._removes == ["rollout0"]  # another one is on its way in


@pytest.mark.parametrize(
    ("action", "replica", "said"),
    [
        ("remove", REPLICA, "is the run's last replica: add another first"),
        ("remove", "127.0.0.1:9", "no rollout replica at 127.0.0.1:9 in this run"),
        ("add", REPLICA, f"rollout server {REPLICA} already serves this run"),
        ("add", "127.0.0.1:9", "nothing answers at 127.0.0.1:9"),
    ],
    ids=["the_last_replica", "an_unknown_replica", "a_replica_already_in", "nothing_listening"],
)
def test_a_change_that_cannot_be_made_is_refused_saying_why(running, action, replica, said):
    address, run_id, ppo = running
    lines: list[str] = []
    assert rollout(address, action, replica, run_id, write=lines.append) == 1
    assert said in lines[-1], lines
    assert ppo.membership._adds == [] and ppo.membership._removes == []


def test_an_unknown_run_and_a_bad_address_are_refused(running, capsys):
    address, run_id, _ = running
    lines: list[str] = []
    assert rollout(address, "add", "127.0.0.1:7002", "nope", write=lines.append) == 1
    assert "no run 'nope'" in lines[-1]
    # the CLI checks the address before dialling: argparse's exit 2
    with pytest.raises(SystemExit) as exit_:
        cli.main(["rollout", "add", "localhost", "--run-id", run_id, "--coordinator", address])
    assert exit_.value.code == 2 and "must be HOST:PORT" in capsys.readouterr().err


def test_the_cli_verb_reaches_the_service(running, capsys):
    address, run_id, ppo = running
    argv = ["rollout", "add", "127.0.0.1:7003", "--run-id", run_id, "--coordinator", address]
    assert cli.main(argv) == 0
    assert "127.0.0.1:7003 joins run" in capsys.readouterr().out
    assert ppo.membership._adds == ["127.0.0.1:7003"]


def test_adding_an_address_nothing_listens_on_is_refused_at_once():
    """The real probe: a port nothing listens on is refused when asked (before, the ask
    was taken, `meshrl rollout add` exited 0, and the server stayed out at the boundary)."""
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing serves it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    roles = Roles(rollouts=[SimpleNamespace(address=REPLICA)], actor=None, reward=None)
    membership = PoolMembership(None, SimpleNamespace(roles=roles), None, lambda version: None)
    with pytest.raises(ValueError, match=f"nothing answers at 127.0.0.1:{port}"):
        membership.ask_add(f"127.0.0.1:{port}")
    assert membership._adds == []
