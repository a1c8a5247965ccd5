"""Ray launcher: every role server runs under a Ray actor placed in a placement group.

Resource pools (`launcher.resource_pool`, verl's `resource_pool_spec`) become placement
groups, one bundle per node. Roles mapped to the same pool (`launcher.role_pool`) are
co-located: they share bundle 0 and split its CPUs/GPUs, while rollout replicas spread
over the pool's bundles (replica i on bundle i mod nodes). A role in a pool of its own is
split from the others. Each actor starts its role server as a subprocess on its node
(the servers install signal handlers and trainers may fork torchrun ranks, which an
in-actor server could not), waits for its health, and reports the address; the
coordinator then drives the servers exactly as in the local case. A server exits when its
actor dies (MESHRL_PARENT_PID), so a killed actor leaves no server behind.

Limits: a trainer's ranks stay on one node (its bundle); the run folder must be on a
filesystem every node sees (checkpoints are written by the trainers).
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshrl.config import RunConfig
from meshrl.config.sections import ResourcePoolConfig
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.security import SecuritySettings

log = logging.getLogger(__name__)

DEFAULT_POOL = "global"


@dataclass(frozen=True)
class RoleSpec:
    """One role server to run: which module, with which arguments."""

    name: str  # "rollout0", "actor", ...
    role: str  # "rollout", "actor", "critic", "ref", "reward"
    module: str
    extra: tuple[str, ...] = ()
    world_size: int = 1  # trainer ranks (torchrun on one node)


@dataclass(frozen=True)
class Placement:
    """Where a role server ended up."""

    name: str
    pool: str
    bundle: int
    address: str
    node_id: str
    pid: int


def role_specs(cfg: RunConfig) -> list[RoleSpec]:
    """The servers a run needs, in the order the local launcher starts them."""
    specs = [
        RoleSpec(f"rollout{i}", "rollout", "services.rollout.server")
        for i in range(cfg.actor_rollout_ref.rollout.replicas)
    ]
    trainer = "services.trainer.server"
    specs.append(
        RoleSpec(
            "actor", "actor", trainer, ("--role", "actor"), cfg.actor_rollout_ref.actor.world_size
        )
    )
    if cfg.use_critic_server:
        specs.append(
            RoleSpec("critic", "critic", trainer, ("--role", "critic"), cfg.critic.world_size)
        )
    if cfg.use_ref_server:
        specs.append(
            RoleSpec("ref", "ref", trainer, ("--role", "ref"), cfg.actor_rollout_ref.ref.world_size)
        )
    specs.append(
        RoleSpec(
            "reward",
            "reward",
            "services.reward.server",
            ("--num-workers", str(cfg.reward.num_workers)),
        )
    )
    return specs


def pools(cfg: RunConfig) -> dict[str, ResourcePoolConfig]:
    """The configured pools, plus the default pool when some role is mapped to none."""
    out = dict(cfg.launcher.resource_pool)
    unmapped = any(
        cfg.launcher.role_pool.get(s.role, DEFAULT_POOL) == DEFAULT_POOL for s in role_specs(cfg)
    )
    if unmapped and DEFAULT_POOL not in out:
        out[DEFAULT_POOL] = ResourcePoolConfig()
    return out


def assign_bundles(cfg: RunConfig) -> dict[str, tuple[str, int]]:
    """name -> (pool, bundle index): co-located roles share bundle 0, replicas spread."""
    specs = pools(cfg)
    placed = {}
    for spec in role_specs(cfg):
        pool = cfg.launcher.role_pool.get(spec.role, DEFAULT_POOL)
        replica = int(spec.name[len("rollout") :]) if spec.role == "rollout" else 0
        placed[spec.name] = (pool, replica % specs[pool].nodes)
    return placed


def bundle_resources(pool: ResourcePoolConfig) -> dict[str, float]:
    res = {"CPU": pool.cpus_per_node, **pool.resources}
    if pool.gpus_per_node:
        res["GPU"] = pool.gpus_per_node
    return res


def actor_shares(cfg: RunConfig) -> dict[str, tuple[float, float]]:
    """name -> (CPUs, GPUs) the actor asks of its bundle: an equal share of it."""
    placed, specs = assign_bundles(cfg), pools(cfg)
    crowd: dict[tuple[str, int], int] = {}
    for where in placed.values():
        crowd[where] = crowd.get(where, 0) + 1
    return {
        name: (
            specs[pool].cpus_per_node / crowd[(pool, b)],
            specs[pool].gpus_per_node / crowd[(pool, b)],
        )
        for name, (pool, b) in placed.items()
    }


@ray.remote(max_restarts=0)
class RoleServerActor:
    """Owns one role server process on its node."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None
        self.command: list[str] = []
        self.log_path = ""
        self.address = ""
        self.env: dict[str, str] = {}
        self.instance_id = ""

    def start(
        self, spec: RoleSpec, log_path: str, timeout_s: float, env: dict[str, str]
    ) -> tuple[str, str, int]:
        """Starts the server on a free port of this node, with `env` added (TLS / token);
        returns (address, node id, pid)."""
        from meshrl.launcher.local import server_command
        from meshrl.launcher.ports import free_port

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.command = server_command(spec.module, host, port, list(spec.extra), spec.world_size)
        self.log_path = log_path
        self.env = env
        self.address = f"{host}:{port}"
        self._spawn()
        self._wait(timeout_s)
        assert self.popen is not None  # started by _spawn
        return self.address, ray.get_runtime_context().get_node_id(), self.popen.pid

    def restart(self, timeout_s: float) -> str:
        """Stops (if needed) and starts the server again on its address."""
        self.stop()
        self._spawn()
        self._wait(timeout_s)
        return self.address

    def _spawn(self) -> None:
        from meshrl.rpc.server import INSTANCE_ENV

        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
            MESHRL_PARENT_PID=str(os.getpid()),  # the server exits when this actor dies
            **self.env,
        )
        # New at every start: _wait checks that the server answering is this process.
        self.instance_id = uuid.uuid4().hex[:12]
        env[INSTANCE_ENV] = self.instance_id
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(
                self.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _wait(self, timeout_s: float) -> None:
        from meshrl.rpc.client import wait_for_health
        from meshrl.rpc.security import SecuritySettings
        from meshrl.rpc.server import instance_health_name

        security = SecuritySettings.from_env({**os.environ, **self.env})
        service = instance_health_name(self.instance_id)
        wait_for_health(self.address, service, timeout_s, alive=self.alive, security=security)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`; what it started
        is stopped even when the server itself already died."""
        from meshrl.launcher.server_processes import stop_server

        if self.popen is not None:
            stop_server(self.popen, self.instance_id, grace_s)


class RayLauncher:
    """Same interface as LocalLauncher: `start()` -> Endpoints, `stop()` leaves nothing."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg = cfg
        self.log_dir = Path(run_dir).resolve() / "logs"
        self.groups: dict[str, PlacementGroup] = {}  # pool id -> PlacementGroup
        self.actors: dict[str, Any] = {}  # role name -> actor handle (untyped methods)
        self.placements: dict[str, Placement] = {}
        self._owns_ray = False

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        ray.init(
            address=self.cfg.launcher.ray_address,
            namespace="meshrl",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        self._owns_ray = self.cfg.launcher.ray_address is None  # a private cluster dies with us

    def _make_groups(self) -> None:
        timeout = self.cfg.launcher.startup_timeout_s
        # The most constrained pools first, so a loose pool cannot take a node they need.
        order = sorted(
            pools(self.cfg).items(), key=lambda kv: (not kv[1].resources, -kv[1].gpus_per_node)
        )
        for pool_id, pool in order:
            strategy = "STRICT_SPREAD" if pool.nodes > 1 else "PACK"
            group = placement_group([bundle_resources(pool)] * pool.nodes, strategy=strategy)
            self.groups[pool_id] = group
            try:
                ray.get(group.ready(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"launcher.resource_pool.{pool_id}: {pool.nodes} x {bundle_resources(pool)} cannot "
                    f"be placed within {timeout:.0f}s; cluster has {ray.available_resources()}"
                ) from None

    def start(self) -> Endpoints:
        self._connect()
        try:
            self._make_groups()
            placed, shares = assign_bundles(self.cfg), actor_shares(self.cfg)
            env = SecuritySettings.from_config(self.cfg.security).to_env()  # TLS / token files
            pending = {}
            for spec in role_specs(self.cfg):
                pool, bundle = placed[spec.name]
                cpus, gpus = shares[spec.name]
                # ray.remote's class decorator is typed as giving back the class itself
                actor = RoleServerActor.options(  # type: ignore[attr-defined]
                    num_cpus=cpus,
                    num_gpus=gpus,
                    name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.groups[pool], placement_group_bundle_index=bundle
                    ),
                ).remote()
                self.actors[spec.name] = actor
                log_path = str(self.log_dir / f"{spec.name}.log")
                pending[spec.name] = (
                    actor.start.remote(spec, log_path, self.cfg.launcher.startup_timeout_s, env),
                    pool,
                    bundle,
                )
            for name, (ref, pool, bundle) in pending.items():
                address, node_id, pid = ray.get(
                    ref, timeout=self.cfg.launcher.startup_timeout_s + 30
                )
                self.placements[name] = Placement(name, pool, bundle, address, node_id, pid)
                log.info(
                    "%s: pool %s bundle %d, node %s, %s (pid %d)",
                    name,
                    pool,
                    bundle,
                    node_id[:8],
                    address,
                    pid,
                )
        except BaseException:
            self.stop()
            raise
        return self.endpoints()

    def endpoints(self) -> Endpoints:
        return Endpoints.from_addresses({name: pl.address for name, pl in self.placements.items()})

    # --- recovery (services/coordinator/recovery/recovery.py's Restarter) ---------------------------
    def dead_roles(self) -> list[str]:
        """Role servers whose process (or whose actor) is gone."""
        dead = []
        for name, actor in self.actors.items():
            try:
                if not ray.get(actor.alive.remote(), timeout=10):
                    dead.append(name)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(name)
        return dead

    def restart(self, name: str) -> str:
        """Starts a dead role server again under its actor, on the same address."""
        timeout = self.cfg.launcher.startup_timeout_s
        return ray.get(self.actors[name].restart.remote(timeout), timeout=timeout + 30)

    def stop(self) -> None:
        if not ray.is_initialized():
            return
        stops = [actor.stop.remote() for actor in self.actors.values()]
        try:
            ray.get(stops, timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead actor took its server with it (PDEATHSIG)
            log.warning("stopping role servers: %s", e)
        for actor in self.actors.values():
            ray.kill(actor)
        for group in self.groups.values():
            remove_placement_group(group)
        self.actors.clear()
        self.groups.clear()
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> RayLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
