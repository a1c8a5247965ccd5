"""``launcher``: how and where the role servers start (local, Ray, external)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from meshrl.config.sections.base import OneOrList, Section


class ResourcePoolConfig(Section):
    """A Ray resource pool (verl's `resource_pool_spec` entry): one bundle per node."""

    nodes: int = Field(1, ge=1)
    """Nodes the pool spans (one placement-group bundle each, on distinct nodes when > 1)."""
    cpus_per_node: float = Field(1.0, gt=0)
    """Ray CPUs each bundle reserves; the role servers placed on it share them."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs each bundle reserves; co-located role servers share them."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each bundle needs, e.g. {"node2": 1} pins it to nodes offering that."""


LAUNCHER_ROLES = ("rollout", "actor", "critic", "ref", "reward")


class LauncherConfig(Section):
    kind: Literal["local", "ray", "external"] = "local"
    """local subprocesses, Ray actors, or servers already running (addresses below)."""
    host: str = "127.0.0.1"
    """Interface the role servers bind to (ray: each node's own address is used)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """Seconds a role server has to answer its health check once started or restarted
    (external: to answer again; ray: also to place each resource pool)."""
    max_restarts: int = Field(2, ge=0)
    """Restarts of a dead role server before the run stops."""
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """local: how a role server process starts. forkserver: forked from one process that
    imported torch, transformers and the servers once (ready in about a second; it never
    touches CUDA). spawn: a fresh `python -m` each (seconds of imports per server)."""
    addresses: dict[str, OneOrList[str]] = Field(default_factory=dict)
    """external: role -> ["host:port", ...] (rollout may have several; one "host:port" alone
    is a list of one)."""
    ray_address: str | None = None
    """ray: the cluster to join ("auto", "HOST:PORT"); None = start a private one here."""
    resource_pool: dict[str, ResourcePoolConfig] = Field(default_factory=dict)
    """ray: pool id -> resources. Roles mapped to one pool are co-located (share its bundles)."""
    role_pool: dict[str, str] = Field(default_factory=dict)
    """ray: role (rollout, actor, critic, ref, reward) -> pool id; unnamed roles use "global"."""
    role_gpus: dict[str, str] = Field(default_factory=dict)
    """local: role -> the GPUs its server sees (CUDA_VISIBLE_DEVICES, e.g. "0" or "0,1");
    unnamed roles see every GPU. Roles on one GPU are co-located (weights move by cuda_ipc),
    roles on different GPUs are split (weights move by NCCL)."""
    check_gpu_memory: bool = True
    """With trainer.device=cuda, estimate each role's GPU memory per phase from the model's
    shape and the config before any server starts, and refuse a plan whose roles on one
    GPU need more than it has (docs/memory.md)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """The GPU size the estimate is checked against. None: the smallest GPU this machine
    sees (local launcher); with the ray or external launchers, not checked unless given."""
    metrics_port_base: int | None = Field(None, ge=1, le=65535)
    """local: give each role server a Prometheus endpoint (http://HOST:PORT/metrics), on
    consecutive ports from this one in the order rollout0, rollout1, ..., actor, critic,
    ref, reward (only the roles the run starts). None: no endpoints, whatever
    MESHRL_METRICS_PORT says in the launcher's environment (docs/deploy.md, "Metrics")."""

    @field_validator("role_gpus", mode="before")
    @classmethod
    def _gpu_indices_as_text(cls, value):
        # YAML reads `rollout: 1` as an int; CUDA_VISIBLE_DEVICES is text.
        if isinstance(value, dict):
            return {
                role: str(gpus) if isinstance(gpus, int) else gpus for role, gpus in value.items()
            }
        return value

    @field_validator("role_pool")
    @classmethod
    def _pool_roles_known(cls, value: dict[str, str]) -> dict[str, str]:
        # that each pool is in resource_pool reads two keys: meshrl/config/rules.py
        for role in value:
            if role not in LAUNCHER_ROLES:
                raise ValueError(
                    f"launcher.role_pool.{role}: unknown role (one of {', '.join(LAUNCHER_ROLES)})"
                )
        return value

    @field_validator("role_gpus")
    @classmethod
    def _gpus_of_known_roles(cls, value: dict[str, str]) -> dict[str, str]:
        for role, gpus in value.items():
            if role not in LAUNCHER_ROLES:
                raise ValueError(
                    f"launcher.role_gpus.{role}: unknown role (one of {', '.join(LAUNCHER_ROLES)})"
                )
            if not re.fullmatch(r"\d+(,\d+)*", gpus):
                raise ValueError(
                    f'launcher.role_gpus.{role}={gpus!r}: expected GPU indices like "0" or "0,1"'
                )
        return value
