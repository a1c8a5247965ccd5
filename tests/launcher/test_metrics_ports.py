"""`launcher.metrics_port_base`: the local launcher gives each role server a Prometheus
port of its own, in a fixed order, and passes none on otherwise."""

from __future__ import annotations

import pytest

from meshrl.config import build_config
from meshrl.launcher import local
from meshrl.launcher.local import LocalLauncher
from meshrl.rpc.metrics_port import METRICS_PORT_ENV

BASE = 19100
EVERY_ROLE = [
    "algorithm.adv_estimator=gae",  # a critic
    "algorithm.use_kl_in_reward=true",  # a reference
    "actor_rollout_ref.rollout.replicas=2",
]


def test_each_server_gets_the_next_port_in_role_order(tmp_path):
    cfg = build_config({}, [*EVERY_ROLE, f"launcher.metrics_port_base={BASE}"])
    plan = LocalLauncher(cfg, tmp_path).plan()
    assert [(p.name, p.metrics_port) for p in plan] == [
        ("rollout0", BASE),
        ("rollout1", BASE + 1),
        ("actor", BASE + 2),
        ("critic", BASE + 3),
        ("ref", BASE + 4),
        ("reward", BASE + 5),
    ]
    grpc_ports = {int(p.address.rsplit(":", 1)[1]) for p in plan}
    assert not grpc_ports & set(range(BASE, BASE + 6))  # never a gRPC port too


def test_roles_the_run_does_not_start_take_no_port(tmp_path):
    cfg = build_config({}, ["algorithm.adv_estimator=grpo", f"launcher.metrics_port_base={BASE}"])
    plan = LocalLauncher(cfg, tmp_path).plan()
    assert [(p.name, p.metrics_port) for p in plan] == [
        ("rollout0", BASE),
        ("actor", BASE + 1),
        ("reward", BASE + 2),
    ]


def test_no_base_no_ports(tmp_path):
    plan = LocalLauncher(build_config({}, EVERY_ROLE), tmp_path).plan()
    assert all(p.metrics_port is None for p in plan)


class _Started:
    pid = 4242

    def poll(self):
        return None


@pytest.mark.parametrize("base", [None, BASE])
def test_the_launchers_own_variable_is_not_inherited(tmp_path, monkeypatch, base):
    # Inherited by every server, one port would be bound by the first and fail the others.
    monkeypatch.setenv(METRICS_PORT_ENV, "9999")
    given = {}

    def fork(command, env, log_path):
        given[command[command.index("-m") + 1]] = env.get(METRICS_PORT_ENV)
        return _Started()

    monkeypatch.setattr(local, "fork_server_process", fork)
    overrides = [] if base is None else [f"launcher.metrics_port_base={base}"]
    launcher = LocalLauncher(build_config({}, overrides), tmp_path)
    launcher._spawn(launcher.plan()[0])
    assert given == {"services.rollout.server": None if base is None else str(base)}


def test_a_base_out_of_range_is_refused():
    from meshrl.config import ConfigError

    with pytest.raises(ConfigError, match="launcher.metrics_port_base: Input should be less"):
        build_config({}, ["launcher.metrics_port_base=70000"])
