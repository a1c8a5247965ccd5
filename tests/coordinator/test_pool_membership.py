"""PoolMembership at a step boundary: a replica that went down is restarted and rejoins once
it reports the run's weight version; without a launcher to restart it the run goes on with
the others; a joiner that reports another version stays out. Clients are stand-ins."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from meshrl.config import build_config
from meshrl.launcher.endpoints import Endpoints
from services.coordinator.recovery.pool_membership import PoolMembership
from services.coordinator.roles import role_servers
from services.coordinator.roles.role_servers import RoleServers

VERSION = 3
SERVED: dict[str, int] = {}  # address -> the weight version its stand-in reports


class StandInRollout:
    def __init__(self, address: str, timeout_s: float):
        self.address = address

    def initialize(self, config_yaml: str, run_dir: str = ""):
        return SimpleNamespace(gpus=[])

    def info(self):
        return SimpleNamespace(weight_version=SERVED.get(self.address, VERSION))


class Restarter:
    def __init__(self):
        self.restarted: list[str] = []

    def restart(self, name: str) -> str:
        self.restarted.append(name)
        return f"127.0.0.1:{9000 + len(self.restarted)}"

    def dead_roles(self) -> list[str]:
        return []


@pytest.fixture
def servers(monkeypatch, tmp_path):
    monkeypatch.setattr(role_servers, "RolloutClient", StandInRollout)
    SERVED.clear()
    endpoints = Endpoints(
        rollout=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], actor="a:1", reward="r:1"
    )
    with ThreadPoolExecutor(2) as pool:
        yield RoleServers(build_config({}, []), endpoints, tmp_path, pool)


def membership(servers, restarter=None):
    synced: list[list[str]] = []  # the replicas each resync went to

    def resync(version):
        assert version == VERSION
        synced.append(list(servers.roles.rollout_names))

    # stand-in replicas: every address answers the probe `ask_add` sends
    return PoolMembership(servers.cfg, servers, restarter, resync, probe=lambda a: False), synced


def test_a_replica_that_went_down_is_restarted_and_rejoins_after_the_sync(servers, caplog):
    caplog.set_level(logging.INFO, logger="services.coordinator")
    restarter = Restarter()
    pool, synced = membership(servers, restarter)
    assert pool.apply([], VERSION) is False and synced == []  # nothing to change
    assert pool.apply(["rollout1"], VERSION) is True
    assert restarter.restarted == ["rollout1"]
    assert servers.addresses()["rollout1"] == "127.0.0.1:9001"  # its new address
    assert synced == [["rollout0", "rollout2", "rollout1"]]
    assert "rollout replica rollout1 joined the pool with weight version 3" in caplog.text


def test_without_a_restarter_the_run_goes_on_with_the_replicas_left(servers, caplog):
    pool, synced = membership(servers)
    pool.apply(["rollout2"], VERSION)
    assert synced == [["rollout0", "rollout1"]]
    assert "no launcher restarts it: the run goes on with 2 replica(s)" in caplog.text


def test_a_joiner_reporting_another_version_stays_out(servers, caplog):
    pool, synced = membership(servers)
    SERVED["127.0.0.1:7"] = VERSION - 1
    pool.ask_add("127.0.0.1:7")
    pool.apply([], VERSION)
    assert synced == [  # synced with it, then again without it
        ["rollout0", "rollout1", "rollout2", "rollout3"],
        ["rollout0", "rollout1", "rollout2"],
    ]
    assert "reports weight version 2, not 3: it stays out of the pool" in caplog.text
    assert "rollout3" not in servers.added


def test_added_and_removed_replicas_and_names_never_reused(servers):
    pool, synced = membership(servers)
    pool.ask_add("127.0.0.1:7")
    pool.ask_remove("127.0.0.1:1")
    pool.apply([], VERSION)
    assert synced == [["rollout1", "rollout2", "rollout3"]]
    assert servers.launched_addresses() == {
        "rollout1": "127.0.0.1:2", "rollout2": "127.0.0.1:3", "actor": "a:1", "reward": "r:1"
    }  # fmt: skip
    pool.ask_add("127.0.0.1:8")
    pool.apply([], VERSION)
    assert synced[-1] == ["rollout1", "rollout2", "rollout3", "rollout4"]


def test_a_replica_added_by_address_that_goes_down_is_not_restarted(servers, caplog):
    restarter = Restarter()
    pool, synced = membership(servers, restarter)
    pool.ask_add("127.0.0.1:7")
    pool.apply([], VERSION)
    pool.apply(["rollout3"], VERSION)
    assert restarter.restarted == []  # the launcher never started it
    assert synced[-1] == ["rollout0", "rollout1", "rollout2"]
    assert "rollout replica rollout3 went down and no launcher restarts it" in caplog.text
