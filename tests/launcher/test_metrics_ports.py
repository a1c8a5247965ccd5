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


def _free_run_of_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now."""
    import socket

    from meshrl.launcher.ports import free_port

    for _ in range(50):
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_role_server_of_a_run_serves_its_metrics(tmp_path):
    import urllib.request

    from meshrl.testing.tiny_model import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model", seed=0, hidden=32, intermediate=64)
    base = _free_run_of_ports(5)
    cfg = build_config(
        {},
        [
            f"actor_rollout_ref.model.path={model}",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            f"launcher.metrics_port_base={base}",
        ],
    )
    with LocalLauncher(cfg, tmp_path / "run") as launcher:
        launcher.start()  # health checks: every server has answered calls
        for offset, name in enumerate(["rollout0", "actor", "critic", "ref", "reward"]):
            assert launcher.processes[name].metrics_port == base + offset
            url = f"http://127.0.0.1:{base + offset}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            assert 'grpc_method="Check",grpc_service="grpc.health.v1.Health"' in text, name
            assert "process_resident_memory_bytes" in text, name
            # the rollout's own metrics from the rollout server alone (before, every server
            # exported them: the reward server reported a rollout weight version)
            assert ("meshrl_rollout_" in text) == (name == "rollout0"), name
        rollout = urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10)
        assert "meshrl_rollout_weight_version -1.0" in rollout.read().decode()
