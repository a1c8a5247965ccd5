"""The rollout pool's membership, changed between steps: replicas that went down come back,
replicas asked for join or leave, and a replica serves only once a weight sync proves that it
holds the run's current weights.

At a step boundary (before the next step, :meth:`PoolMembership.apply`):

- a replica that left the pool (it went down mid-step) is restarted through the launcher
  (the run's Restarter); without one, or for a replica added by address, the run goes on
  with the replicas left, saying so; a restart that fails is tried again at the next boundary;
- a replica asked to leave (``meshrl rollout remove``) leaves the run's servers (its process
  is left running: it is not the run's to stop);
- a rollout server asked to join (``meshrl rollout add``, an address of a running server) is
  initialized with the run's config;

then the weight-sync group is formed again over the new membership and the actor's weights
synced, labelled with the last step done. Each replica that joins must report that version
(GetInfo), or it leaves again and the others are synced without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from meshrl.config import ConfigError, RunConfig
from meshrl.rpc.client import unreachable
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.recovery.recovery import Restarter
from services.coordinator.roles.role_servers import RoleServers

log = logging.getLogger(__name__)


class ReplicaRefused(ValueError):
    """A change of the pool that cannot be made (an address already serving the run, one that
    does not, or the last replica asked to leave)."""


class PoolMembership:
    """Changes of the run's rollout replicas, asked from any thread (the coordinator
    service) and made by the run's thread between steps."""

    def __init__(
        self,
        cfg: RunConfig,
        servers: RoleServers,
        restarter: Restarter | None,
        resync: Callable[[int], None],
        probe: Callable[[str], bool] = unreachable,
    ):
        """``resync(version)``: rebuilds the weight syncer and the step runner (and so the
        pool) over ``servers``' current rollout clients, and syncs them to ``version``;
        ``probe(address)``: True when nothing answers a health check there."""
        self.probe = probe
        self.cfg = cfg
        self.servers = servers
        self.restarter = restarter
        self.resync = resync
        self._lock = threading.Lock()
        self._adds: list[str] = []
        self._removes: list[str] = []
        self.waiting: list[str] = []
        """Replicas down whose restart failed: tried again at the next boundary."""

    # --- asked from any thread ----------------------------------------------------------
    def ask_add(self, address: str) -> None:
        """``address`` (a running rollout server) joins at the next step boundary; refused at
        once when nothing answers there (before, the ask was taken, exit 0, and the server
        stayed out at the boundary with a warning the asker never saw)."""
        if self.probe(address):
            raise ReplicaRefused(
                f"nothing answers at {address} (no health check answered within 3 s): start "
                "the rollout server there first, or correct the address"
            )
        with self._lock:
            if address in self._rollout_addresses().values() or address in self._adds:
                raise ReplicaRefused(f"rollout server {address} already serves this run")
            self._adds.append(address)
        log.info("rollout server %s joins the pool at the next step boundary", address)

    def ask_remove(self, address: str) -> None:
        """The replica at ``address`` leaves at the next step boundary."""
        with self._lock:
            by_address = {a: n for n, a in self._rollout_addresses().items()}
            if address in self._adds:  # not joined yet: it never will
                self._adds.remove(address)
                return
            name = by_address.get(address)
            if name is None:
                known = ", ".join(sorted(by_address)) or "none"
                raise ReplicaRefused(
                    f"no rollout replica at {address} in this run (its replicas: {known})"
                )
            staying = set(by_address.values()) - set(self._removes) - {name}
            if not staying and not self._adds:  # one asked to join counts: a swap
                raise ReplicaRefused(
                    f"rollout server {address} is the run's last replica: add another first"
                )
            if name not in self._removes:
                self._removes.append(name)
        log.info("rollout replica %s (%s) leaves the pool at the next step boundary", name, address)

    def _rollout_addresses(self) -> dict[str, str]:
        return {n: c.address for n, c in self.servers.roles.named_rollouts().items()}

    # --- at a step boundary, in the run's thread ---------------------------------------
    def has_changes(self) -> bool:
        """Whether ``apply`` has anything to do besides replicas that departed."""
        with self._lock:
            return bool(self._adds or self._removes or self.waiting)

    def apply(self, departed: list[str], version: int) -> bool:
        """Brings the replicas that ``departed`` (went down) back, makes the changes asked
        for, and syncs every replica to ``version``; True when anything changed (the step
        runner and its pool are then new)."""
        with self._lock:
            adds, removes = self._adds, self._removes
            self._adds, self._removes = [], []
        down, self.waiting = [*self.waiting, *departed], []
        if not (adds or removes or down):
            return False
        joining = [name for name in down if name not in removes and self._restart(name)]
        joining += [self.servers.add_rollout(address) for address in adds]
        joining = [name for name in joining if self._initialize(name)]
        for name in removes:  # after the joins: a swap never leaves the pool empty
            self._remove(name)
        self._sync(joining, version)
        rollouts = self.servers.roles.rollout_names
        log.info("rollout pool: %d replicas (%s)", len(rollouts), ", ".join(rollouts))
        return True

    def _remove(self, name: str) -> None:
        names = self.servers.roles.rollout_names
        if name not in names:
            return  # went down meanwhile and was not brought back
        if len(names) == 1:
            log.warning(
                "rollout replica %s stays in the pool, asked to leave: no other replica is "
                "left to serve", name,
            )  # fmt: skip
            return
        self.servers.remove_rollout(name)
        log.info("rollout replica %s left the pool (asked)", name)

    def _restart(self, name: str) -> bool:
        """Restarts a replica that went down; False when it stays out of the run for now."""
        added = name in self.servers.added  # no launcher of ours started it
        if name in self.servers.roles.rollout_names:
            self.servers.remove_rollout(name)  # dead: out of the servers until it is back
        if self.restarter is None or added:
            log.warning(
                "rollout replica %s went down and no launcher restarts it: the run goes on "
                "with %d replica(s)", name, len(self.servers.roles.rollouts),
            )  # fmt: skip
            return False
        try:
            address = self.restarter.restart(name)
        except Exception as e:  # noqa: BLE001 - a replica that cannot start yet is tried later
            log.warning("rollout replica %s could not be restarted (%s); trying again at the "
                        "next step", name, e)  # fmt: skip
            self.waiting.append(name)
            return False
        self.servers.set_rollout(name, address)
        log.info("rollout replica %s restarted at %s", name, address)
        return True

    def _initialize(self, name: str) -> bool:
        """Initializes a joining replica with the run's config; False (and out) if it fails."""
        try:
            self.servers.initialize([name])
        except (RoleCallError, ConfigError) as e:
            self._drop(name, f"could not be initialized ({e})")
            return False
        return True

    def _sync(self, joining: list[str], version: int) -> None:
        """Syncs every replica to ``version``; each of ``joining`` must then report it. A
        sync that fails with joiners drops them and syncs the others again."""
        try:
            self.resync(version)
        except (RoleCallError, RuntimeError) as e:
            if not joining:
                raise
            for name in joining:
                self._drop(name, f"failed its weight sync ({e})")
            self.resync(version)
            return
        wrong = []
        for name, client in self.servers.roles.named_rollouts().items():
            if name in joining and (served := client.info().weight_version) != version:
                wrong.append(name)
                self._drop(name, f"reports weight version {served}, not {version}")
        if wrong:
            self.resync(version)
        for name in joining:
            if name not in wrong:
                log.info("rollout replica %s joined the pool with weight version %d", name, version)

    def _drop(self, name: str, why: str) -> None:
        address = self.servers.roles.named_rollouts()[name].address
        self.servers.remove_rollout(name)
        log.warning("rollout replica %s (%s) %s: it stays out of the pool", name, address, why)
