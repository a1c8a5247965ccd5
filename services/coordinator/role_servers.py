"""The run's role servers as the coordinator sees them: one typed client each, the GPUs each
computes on, and their initialization with the run's config."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshrl.config import ConfigError, RunConfig, config_to_yaml
from meshrl.gpus import count_gpus
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.ppo_step import Roles
from services.reward.client import RewardClient
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient

log = logging.getLogger(__name__)

RoleClient = RolloutClient | TrainerClient | RewardClient


def connect(cfg: RunConfig, endpoints: Endpoints) -> Roles:
    """Clients of every role server at ``endpoints`` (channels open lazily: nothing is called)."""
    t = cfg.trainer.rpc_timeout_s
    return Roles(
        rollouts=[RolloutClient(a, t) for a in endpoints.rollout],
        actor=TrainerClient(endpoints.actor, t, "actor"),
        reward=RewardClient(endpoints.reward, t),
        critic=TrainerClient(endpoints.critic, t, "critic") if endpoints.critic else None,
        ref=TrainerClient(endpoints.ref, t, "ref") if endpoints.ref else None,
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
        # Launcher name -> the GPUs its server computes on (ServerInfo.gpus at Initialize):
        # perf/throughput is per distinct GPU of the run, as verl's is.
        self.gpus: dict[str, list[str]] = {}

    @property
    def num_gpus(self) -> int:
        return count_gpus(self.gpus.values())

    def named(self) -> dict[str, RoleClient]:
        """Launcher names (rollout0, actor, critic, ref, reward) -> clients."""
        roles = self.roles
        named: dict[str, RoleClient] = {f"rollout{i}": c for i, c in enumerate(roles.rollouts)}
        named.update(actor=roles.actor, reward=roles.reward)
        named.update({k: c for k, c in (("critic", roles.critic), ("ref", roles.ref)) if c})
        return named

    def addresses(self) -> dict[str, str]:
        """Launcher names -> the addresses their clients dial."""
        return {name: client.address for name, client in self.named().items()}

    def reconnect(self, addresses: dict[str, str]) -> None:
        """Fresh clients for servers (re)started at ``addresses`` (launcher names -> host:port)."""
        self.endpoints = Endpoints.from_addresses(addresses)
        self.roles = connect(self.cfg, self.endpoints)

    def initialize(self, names: list[str] | None = None) -> None:
        """Initialize the named roles (default: all) concurrently with the resolved config."""
        text = config_to_yaml(self.cfg)
        clients = {n: c for n, c in self.named().items() if names is None or n in names}
        futures = {
            n: self.pool.submit(c.initialize, text, str(self.run_dir)) for n, c in clients.items()
        }
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
