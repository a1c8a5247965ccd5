"""The run's role servers as the coordinator sees them: one typed client each, the GPUs each
computes on, and their initialization with the run's config."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from meshrl.config import ConfigError, RunConfig, config_to_yaml
from meshrl.config.placement import loads_one_at_a_time
from meshrl.gpus import count_gpus
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.roles.roles import Roles
from services.env.client import EnvClient
from services.reward.client import RewardClient
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient

log = logging.getLogger(__name__)

RoleClient = RolloutClient | TrainerClient | RewardClient | EnvClient


def connect(cfg: RunConfig, endpoints: Endpoints, rollout_names: list[str] | None = None) -> Roles:
    """Clients of every role server at ``endpoints`` (channels open lazily: nothing is called).
    ``rollout_names``: the replicas' names, in the order of ``endpoints.rollout``."""
    t = cfg.trainer.rpc_timeout_s
    names = rollout_names or [f"rollout{i}" for i in range(len(endpoints.rollout))]
    return Roles(
        rollouts=[RolloutClient(a, t) for a in endpoints.rollout],
        rollout_names=list(names),
        actor=TrainerClient(endpoints.actor, t, "actor"),
        reward=RewardClient(endpoints.reward, t),
        critic=TrainerClient(endpoints.critic, t, "critic") if endpoints.critic else None,
        ref=TrainerClient(endpoints.ref, t, "ref") if endpoints.ref else None,
        env=EnvClient(endpoints.env, t) if endpoints.env else None,
    )


class RoleServers:
    """The clients of a run's role servers under their launcher names, re-made when a
    server is restarted at another address."""

    def __init__(
        self, cfg: RunConfig, endpoints: Endpoints, run_dir: Path, pool: ThreadPoolExecutor
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.pool = pool
        self.endpoints = endpoints
        self.roles = connect(cfg, endpoints)
        self.added: set[str] = set()
        """Rollout replicas added by address during the run (no launcher restarts them)."""
        self._next_rollout = len(self.roles.rollouts)
        # Launcher name -> the GPUs its server computes on (ServerInfo.gpus at Initialize):
        # perf/throughput is per distinct GPU of the run, as verl's is.
        self.gpus: dict[str, list[str]] = {}

    @property
    def num_gpus(self) -> int:
        return count_gpus(self.gpus.values())

    def named(self) -> dict[str, RoleClient]:
        """Launcher names (rollout0, actor, critic, ref, reward) -> clients."""
        roles = self.roles
        named: dict[str, RoleClient] = dict(roles.named_rollouts())
        named.update(actor=roles.actor, reward=roles.reward)
        optional = (("critic", roles.critic), ("ref", roles.ref), ("env", roles.env))
        named.update({k: c for k, c in optional if c})
        return named

    def addresses(self) -> dict[str, str]:
        """Launcher names -> the addresses their clients dial."""
        return {name: client.address for name, client in self.named().items()}

    def launched_addresses(self) -> dict[str, str]:
        """As :meth:`addresses`, less the rollout replicas added by address during the run:
        the servers the launcher started, and can restart."""
        return {n: a for n, a in self.addresses().items() if n not in self.added}

    def reconnect(self, addresses: dict[str, str]) -> None:
        """Fresh clients for servers (re)started at ``addresses`` (launcher names -> host:port)."""
        self.endpoints = Endpoints.from_addresses(addresses)
        names = [name for name in addresses if name.startswith("rollout")]
        self.roles = connect(self.cfg, self.endpoints, names)

    # --- the rollout replicas, between steps (pool_membership.py) ------------------------
    def set_rollout(self, name: str, address: str) -> RolloutClient:
        """A fresh client for replica ``name``, (re)started at ``address``: in its place, or
        last when it had left the run's servers."""
        client = RolloutClient(address, self.cfg.trainer.rpc_timeout_s)
        names = self.roles.rollout_names
        if name in names:
            self.roles.rollouts[names.index(name)] = client
        else:
            names.append(name)
            self.roles.rollouts.append(client)
        return client

    def add_rollout(self, address: str) -> str:
        """A replica started by someone else joins the run's servers; returns its name,
        ``rollout<k>`` with k past every name given so far (never reused)."""
        names = self.roles.rollout_names
        self._next_rollout = max(self._next_rollout, len(names))
        name = f"rollout{self._next_rollout}"
        self._next_rollout += 1
        self.roles.rollouts.append(RolloutClient(address, self.cfg.trainer.rpc_timeout_s))
        names.append(name)
        self.added.add(name)
        return name

    def remove_rollout(self, name: str) -> RolloutClient:
        """Replica ``name`` leaves the run's servers (its process is left as it is)."""
        index = self.roles.rollout_names.index(name)
        del self.roles.rollout_names[index]
        self.added.discard(name)
        return self.roles.rollouts.pop(index)

    def initialize(self, names: list[str] | None = None) -> None:
        """Initialize the named roles (default: all) concurrently with the resolved config;
        one after the other when the memory plan offloads on a shared GPU (each role loads
        its whole model on the GPU before it shards and offloads it: together they would
        need what offloading saves)."""
        text = config_to_yaml(self.cfg)
        clients = {n: c for n, c in self.named().items() if names is None or n in names}
        one_at_a_time = loads_one_at_a_time(self.cfg)
        futures: dict[str, Future] = {}
        for n, c in clients.items():
            futures[n] = self.pool.submit(c.initialize, text, str(self.run_dir))
            if one_at_a_time:
                futures[n].exception()  # waits for it (an error is raised below)
        for name, f in futures.items():
            try:
                self.gpus[name] = list(f.result().gpus)
            except RoleCallError as err:
                if names is not None or err.code_name != "INVALID_ARGUMENT":
                    raise
                # At the start, a server that refuses the run's config (a model folder it
                # cannot read on its machine, a value it cannot serve) says the request is
                # wrong (exit 2, a service's run REJECTED), not that the run failed. A
                # restarted server (``names``) that refuses what its first start took
                # points at the server, not the request: that stays a failure.
                raise ConfigError(f"{err} (the role server refused this run's config)") from err
        if names is None and (gpus := self.num_gpus):
            log.info("the role servers compute on %d GPU(s); perf/throughput is per GPU", gpus)
