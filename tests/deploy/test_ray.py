"""The Ray launcher: resource pools as placement groups, role servers as Ray actors.

The cluster test starts a head with `ray start --head` and a second "node" on the same host
with `ray start --address` (each with 2 CPUs and a custom resource naming it), places the
co-located rollout + actor pool on the head and the reward pool on node2, checks where the
actors landed by their node ids, runs a few PPO steps, and stops its own Ray processes
(not `ray stop`, which would stop every Ray cluster of the host's user).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from meshrl.config import build_config  # noqa: E402
from meshrl.launcher.ports import free_port  # noqa: E402
from meshrl.launcher.ray_launcher import RayLauncher, actor_shares, assign_bundles, pools  # noqa: E402
from meshrl.launcher.server_processes import pids_with_env  # noqa: E402
from meshrl.testing.tiny_model import make_tiny_model_dir  # noqa: E402
from meshrl_app.demo.arithmetic import write_arithmetic_parquet  # noqa: E402
from services.coordinator.metrics.sinks import read_jsonl  # noqa: E402
from services.coordinator.run.run import PPORun  # noqa: E402

pytestmark = [pytest.mark.ray]

POOLS = [
    "launcher.resource_pool.head_pool.cpus_per_node=2",
    "launcher.resource_pool.head_pool.resources={head: 1}",
    "launcher.resource_pool.node2_pool.cpus_per_node=1",
    "launcher.resource_pool.node2_pool.resources={node2: 1}",
    "launcher.role_pool.rollout=head_pool",
    "launcher.role_pool.actor=head_pool",
    "launcher.role_pool.reward=node2_pool",
]


def test_pools_colocate_and_split_roles():
    cfg = build_config(
        {},
        [
            *POOLS,
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.rollout.replicas=2",
            "launcher.resource_pool.head_pool.nodes=2",
        ],
    )
    placed = assign_bundles(cfg)
    # rollout replicas spread over the pool's two bundles; the actor shares bundle 0
    assert placed == {
        "rollout0": ("head_pool", 0),
        "rollout1": ("head_pool", 1),
        "actor": ("head_pool", 0),
        "critic": ("global", 0),
        "reward": ("node2_pool", 0),
    }
    assert set(pools(cfg)) == {"head_pool", "node2_pool", "global"}  # critic unmapped -> global
    shares = actor_shares(cfg)
    assert shares["rollout0"] == shares["actor"] == (1.0, 0.0)  # two on bundle 0 split its 2 CPUs
    assert shares["rollout1"] == (2.0, 0.0) and shares["reward"] == (1.0, 0.0)


def test_role_pool_must_name_a_pool():
    from meshrl.config import ConfigError

    with pytest.raises(ConfigError, match="launcher.role_pool.actor"):
        build_config({}, ["launcher.role_pool.actor=nowhere"])


RAY = str(Path(sys.executable).parent / "ray")  # the CLI of this venv's ray


def _ray(*args: str, env: dict) -> None:
    out = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(
            f"ray {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )


CLUSTER_ENV = "MESHRL_RAY_TEST_CLUSTER"
"""Set to a fresh token in the environment of `ray start`: every process Ray starts
inherits it, so the test stops its own cluster and no other."""


def _processes_of(token: str) -> list[int]:
    """Processes started with ``token`` in their environment, and their descendants (Ray's
    agents are found through their raylet)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found = set(pids_with_env(CLUSTER_ENV, token))
    while children := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= children
    return sorted(found - {os.getpid()})


def _stop_processes_of(token: str, wait_s: float = 10.0) -> None:
    """SIGKILL to this cluster's processes, as `ray stop --force` sends to every Ray
    process (its gcs_server outlives a SIGTERM by more than 15 s)."""
    for pid in _processes_of(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while _processes_of(token) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """A head and a second node on this host; their processes stopped at the end (found by
    a token in their environment, which every process Ray starts inherits).

    127.0.0.2, not 127.0.0.1: Ray swaps 127.0.0.1 for the machine's own network address,
    but leaves the rest of the loopback range alone, so all traffic stays on loopback."""
    token = f"meshrl-ray-test-{uuid.uuid4().hex}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", CLUSTER_ENV: token}
    port = free_port()
    common = [
        "--node-ip-address=127.0.0.2",
        "--num-cpus=2",
        "--disable-usage-stats",
        "--include-log-monitor=false",
    ]
    try:
        _ray(
            "start",
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            '--resources={"head": 1}',
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            # Ray's own default range (10002-19999), below the ports free_port() draws from
            "--min-worker-port=12000",
            "--max-worker-port=12999",
            *common,
            env=env,
        )
        _ray(
            "start",
            f"--address=127.0.0.2:{port}",
            '--resources={"node2": 1}',
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--min-worker-port=13000",
            "--max-worker-port=13999",
            *common,
            env=env,
        )
        ray.init(address=f"127.0.0.2:{port}", namespace="meshrl-test", log_to_driver=False)
        nodes = {
            next(r for r in ("head", "node2") if r in n["Resources"]): n["NodeID"]
            for n in ray.nodes()
            if n["Alive"]
        }
        assert set(nodes) == {"head", "node2"}, ray.nodes()
        yield f"127.0.0.2:{port}", nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop_processes_of(token)
        assert not _processes_of(token), "the test cluster's processes outlived their stop"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_roles_spread_over_two_nodes_and_ppo_steps_complete(two_node_cluster, tmp_path):
    address, nodes = two_node_cluster
    model = make_tiny_model_dir(tmp_path / "model", seed=0, hidden=32, intermediate=64)
    data = write_arithmetic_parquet(tmp_path / "data", n_train=32, n_val=8)
    cfg = build_config(
        {},
        [
            f"data.train_files=[{data['train']}]",
            "data.train_batch_size=8",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "reward.num_workers=1",
            "trainer.total_training_steps=2",
            "trainer.plot=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "launcher.kind=ray",
            f"launcher.ray_address={address}",
            *POOLS,
        ],
    )
    launcher = RayLauncher(cfg, tmp_path / "run")
    try:
        endpoints = launcher.start()
        where = {name: p.node_id for name, p in launcher.placements.items()}
        assert where == {
            "rollout0": nodes["head"],
            "actor": nodes["head"],
            "reward": nodes["node2"],
        }, where
        assert launcher.placements["rollout0"].bundle == launcher.placements["actor"].bundle == 0
        assert all(p.address.startswith("127.0.0.2:") for p in launcher.placements.values())

        run = PPORun(cfg, endpoints, tmp_path / "run")
        try:
            run.setup()
            last = run.train()
        finally:
            run.close()
    finally:
        launcher.stop()
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [1, 2] and "actor/pg_loss" in last
    assert {p.pid for p in launcher.placements.values()}.isdisjoint(_live_pids()), (
        "role servers stopped"
    )
    assert not ray.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()
    )
    (tmp_path / "placements.json").write_text(
        json.dumps({k: v.node_id for k, v in launcher.placements.items()})
    )


def _live_pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}
