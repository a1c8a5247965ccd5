"""External launcher: the role servers already run (docker compose, systemd, another host);
the config names them in `launcher.addresses`, and this launcher only checks and waits.

Nothing is started or stopped here: the servers outlive the run, and the next run calls
Initialize on them again. A server that dies mid-run is restarted by whatever runs it
(compose's `restart: unless-stopped`); the run waits for it and re-initializes it.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2

from meshrl.api.v1 import common_pb2, trainer_pb2_grpc
from meshrl.config import ConfigError, RunConfig
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.client import (
    ServiceUnavailable,
    health_status,
    open_channel,
    wait_for_health,
)

log = logging.getLogger(__name__)

ROLES = ("rollout", "actor", "critic", "ref", "reward", "env")


def needed_roles(cfg: RunConfig) -> list[str]:
    roles = ["rollout", "actor", "reward"]
    roles += ["critic"] if cfg.use_critic_server else []
    roles += ["ref"] if cfg.use_ref_server else []
    roles += ["env"] if cfg.actor_rollout_ref.rollout.multi_turn.enable else []
    return roles


def external_endpoints(cfg: RunConfig) -> Endpoints:
    """Endpoints from `launcher.addresses`; a missing or surplus address fails naming the key."""
    given = cfg.launcher.addresses
    for role in given:
        if role not in ROLES:
            raise ConfigError(
                f"launcher.addresses.{role}: unknown role (expected one of {', '.join(ROLES)})"
            )
    for role in needed_roles(cfg):
        if not given.get(role):
            raise ConfigError(
                f"launcher.addresses.{role}: no address given, and this run needs its {role} server"
            )
    replicas = cfg.actor_rollout_ref.rollout.replicas
    if len(given["rollout"]) != replicas:
        raise ConfigError(
            f"launcher.addresses.rollout: {len(given['rollout'])} address(es) for "
            f"actor_rollout_ref.rollout.replicas={replicas}"
        )
    for role in ("actor", "critic", "ref", "reward", "env"):
        if len(given.get(role, [])) > 1:
            raise ConfigError(f"launcher.addresses.{role}: one address expected, got {given[role]}")
    one = {role: given[role][0] for role in needed_roles(cfg) if role != "rollout"}
    return Endpoints(
        rollout=list(given["rollout"]),
        actor=one["actor"],
        reward=one["reward"],
        critic=one.get("critic"),
        ref=one.get("ref"),
        env=one.get("env"),
    )


# The service of each kind of role server (health is SERVING once its model is loaded);
# actor, critic and ref are trainer servers.
_SERVICES = {
    "rollout": "meshrl.api.v1.RolloutService",
    "trainer": "meshrl.api.v1.TrainerService",
    "reward": "meshrl.api.v1.RewardService",
    "env": "meshrl.api.v1.EnvService",
}
TRAINER_ROLES = ("actor", "critic", "ref")


def _role(name: str) -> str:
    """The config role of a launcher name: rollout0 -> rollout."""
    return name.rstrip("0123456789")


def _service_of(name: str) -> str:
    return _SERVICES.get(_role(name), _SERVICES["trainer"])


def _knows(channel: grpc.Channel, service: str, timeout_s: float) -> bool:
    """Whether the server's health service knows `service` (NOT_FOUND: it does not; any
    other error is not this check's business, the run's calls report it)."""
    try:
        health_status(channel, service, timeout_s)
        return True
    except grpc.RpcError as e:
        return e.code() != grpc.StatusCode.NOT_FOUND


def _check_serves(name: str, address: str, timeout_s: float = 10.0) -> None:
    """Raises ConfigError when the server at `address` does not serve the service of its
    role (two addresses swapped in launcher.addresses): its health service does not know
    the service name, or it is a trainer server of another role (actor and critic
    swapped). Otherwise the run's first call would fail as UNIMPLEMENTED, or the critic's
    calls would go to the actor."""
    channel = open_channel(address)
    try:
        if _knows(channel, _service_of(name), timeout_s):
            trainer_role = _trainer_role(channel, timeout_s) if _role(name) in TRAINER_ROLES else ""
            if trainer_role in ("", _role(name)):
                return
            raise ConfigError(
                f"launcher.addresses.{_role(name)}: {address} is the {trainer_role} role's "
                f"trainer server (started with --role {trainer_role}), not the {_role(name)} "
                "role's; are two addresses swapped?"
            )
        served = [
            kind for kind, service in _SERVICES.items() if _knows(channel, service, timeout_s)
        ]
    finally:
        channel.close()
    what = f"a {' and '.join(served)} server" if served else "no meshrl role service"
    raise ConfigError(
        f"launcher.addresses.{_role(name)}: {address} is {what}, not the {_role(name)} "
        f"role's ({_service_of(name)}); are two addresses swapped?"
    )


def _trainer_role(channel: grpc.Channel, timeout_s: float) -> str:
    """The role a trainer server was started with (its GetInfo, answered before any
    Initialize); "" when it does not say (a failed call is the run's calls' business)."""
    try:
        info = trainer_pb2_grpc.TrainerServiceStub(channel).GetInfo(
            common_pb2.GetInfoRequest(), timeout=timeout_s
        )
    except grpc.RpcError:
        return ""
    return info.role


def _serving(name: str, address: str, timeout_s: float = 3.0) -> bool:
    service = _service_of(name)
    channel = open_channel(address)
    try:
        return health_status(channel, service, timeout_s) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


class ExternalLauncher:
    """Same interface as LocalLauncher: `start()` -> Endpoints once every server answers."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self._endpoints = external_endpoints(cfg)  # fails at once on a bad address list

    def addresses(self) -> list[str]:
        e = self._endpoints
        return [*e.rollout, e.actor, e.reward, *(a for a in (e.critic, e.ref) if a)]

    def start(self) -> Endpoints:
        for name, address in self.named_addresses().items():
            self._wait_for(name, address)
        for name, address in self.named_addresses().items():
            _check_serves(name, address)
        return self._endpoints

    def _wait_for(self, name: str, address: str) -> None:
        """Waits for the server's answer, saying every 10 s how the wait goes: a server that
        refuses connections was 120 s of silence, then an error naming the service only."""
        timeout_s = self.cfg.launcher.startup_timeout_s
        try:
            wait_for_health(address, "", timeout_s, progress=log.info, name=name)
        except ServiceUnavailable as e:
            raise ServiceUnavailable(
                f"{e}; launcher.kind=external starts no server: start it there, or correct "
                f"launcher.addresses.{_role(name)} (launcher.startup_timeout_s={timeout_s:g})"
            ) from None

    def named_addresses(self) -> dict[str, str]:
        """Launcher names (rollout0, actor, ...) -> addresses, as PPORun names its clients."""
        e = self._endpoints
        named = {f"rollout{i}": a for i, a in enumerate(e.rollout)}
        named.update(actor=e.actor, reward=e.reward)
        named.update({k: a for k, a in (("critic", e.critic), ("ref", e.ref)) if a})
        return named

    # --- recovery (services/coordinator/recovery/recovery.py's Restarter) ---------------------------
    # A server that died is brought back by whoever runs it (docker compose's restart
    # policy, systemd); recovering here means waiting for it on the same address.
    def dead_roles(self) -> list[str]:
        """Servers that do not answer, or answer but lost their model (a restarted rollout or
        trainer keeps its role service NOT_SERVING until it is initialized again)."""
        return [
            name for name, address in self.named_addresses().items() if not _serving(name, address)
        ]

    @property
    def recovery_plan(self) -> str:
        return (
            f"waiting up to {self.cfg.launcher.startup_timeout_s:.0f} s for them to answer "
            "again on the same address (this run does not start them: whoever does, such as "
            "compose's restart policy, restarts them)"
        )

    def restart(self, name: str) -> str:
        address = self.named_addresses()[name]
        wait_for_health(
            address, "", self.cfg.launcher.startup_timeout_s, progress=log.info, name=name
        )
        return address

    def stop(self) -> None:
        """The servers are not ours to stop."""

    def __enter__(self) -> ExternalLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
