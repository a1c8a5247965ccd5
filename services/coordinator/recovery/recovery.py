"""Surviving a dead role server: find who died, restart it through the launcher, bring it
back to the run's state, and retry.

- rollout, ref, reward hold no training state: restart, Initialize, re-sync weights to the
  current version (rollout), retry the step that failed.
- actor, critic hold the training state: after a restart both trainers and the coordinator
  go back to the last checkpoint (or to the start when there is none) and the run goes on
  from there; the steps after that checkpoint are run again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from meshrl.config import RunConfig
from meshrl.rpc.client import unreachable
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_ahead import PromptsDrawnAhead
from services.coordinator.recovery.run_checkpoints import RunCheckpoints
from services.coordinator.roles.role_servers import RoleServers

log = logging.getLogger(__name__)

STATEFUL_ROLES = ("actor", "critic")


class Restarter(Protocol):
    """What a launcher offers for recovery (LocalLauncher, RayLauncher, ExternalLauncher).
    An optional ``recovery_plan`` (str) says what its ``restart`` does, for the log line
    (default: :data:`RESTARTING`)."""

    def restart(self, name: str) -> str: ...
    def dead_roles(self) -> list[str]: ...


RESTARTING = "restarting them"


def recovery_plan(restarter: Restarter) -> str:
    return getattr(restarter, "recovery_plan", RESTARTING)


def find_dead(restarter: Restarter, addresses: dict[str, str]) -> list[str]:
    """Role servers whose process exited, else those that no longer answer health checks;
    only the servers of ``addresses`` (a rollout replica taken out of the run is not
    brought back here)."""
    dead = [name for name in restarter.dead_roles() if name in addresses]
    return dead or [name for name, address in addresses.items() if unreachable(address)]


class Recovery:
    """Bounded restarts of a run's dead role servers. A step (or a validation) whose call
    failed counts a failure of that step; past ``launcher.max_restarts`` of one step the run
    ends, naming the checkpoint to resume from. ``resync(version)`` makes rollout serve the
    actor's weights again, labelled ``version``, around the new clients."""

    def __init__(
        self,
        cfg: RunConfig,
        restarter: Restarter | None,
        servers: RoleServers,
        checkpoints: RunCheckpoints,
        resync: Callable[[int], None],
        ahead: PromptsDrawnAhead | None = None,
    ):
        self.cfg = cfg
        self.restarter = restarter  # None: a dead role server ends the run
        self.servers = servers
        self.checkpoints = checkpoints
        self.progress = checkpoints.progress
        self.resync = resync
        self.ahead = ahead
        # Recoveries per step number, kept across rewinds: a crash that recurs each time the
        # run gets back to a step ends the run after launcher.max_restarts, not never.
        self.step_failures: Counter[int] = Counter()

    def count_failure(self, step: int, err: RoleCallError, what: str) -> None:
        """Counts a failure of ``step`` (its validation included) and logs it as ``what``;
        re-raises ``err`` when there is no restarter or the restarts are spent."""
        self.step_failures[step] += 1
        limit = self.cfg.launcher.max_restarts
        if self.restarter is None:
            raise err
        if self.step_failures[step] > limit:
            folder = self.checkpoints.rewind_folder()
            if folder is None:
                resume = "it has no checkpoint yet (trainer.save_freq)"
            else:  # auto looks in this run's folder only, not where resume_mode=<path> took it
                mode = "auto" if folder.parent == self.checkpoints.manager.root else str(folder)
                resume = f"its last checkpoint, {folder}, resumes it: run it again with "
                resume += f"trainer.resume_mode={mode}"
            log.error(
                "%s (%s); launcher.max_restarts=%d recoveries of this step are spent, so the "
                "run ends; %s", what, err, limit, resume,
            )  # fmt: skip
            raise err
        attempt = self.step_failures[step]
        log.warning("%s (%s); recovering (attempt %d of %d)", what, err, attempt, limit)

    def lost_a_server(self) -> bool:
        """Whether a role server of the run is gone (its process exited, or it answers no
        more): a call's error is then the server's death, not its answer."""
        if self.restarter is None:
            return False
        return bool(find_dead(self.restarter, self.servers.launched_addresses()))

    def recover(self, err: RoleCallError, updated: bool = False) -> bool:
        """Restarts dead role servers; True when the run went back to a checkpoint.
        ``updated``: the failed step's updates were done (only its weight sync failed)."""
        assert self.restarter is not None  # count_failure re-raised the error without one
        addresses = self.servers.addresses()
        dead = find_dead(self.restarter, self.servers.launched_addresses())
        if not dead:
            raise err  # the call failed but every server lives: not a crash to recover from
        log.warning("role servers down: %s; %s", ", ".join(dead), recovery_plan(self.restarter))
        for name in dead:
            addresses[name] = self.restarter.restart(name)  # a new port if the old one was taken
        self.servers.reconnect(addresses)  # fresh channels to the new processes
        self.servers.initialize(dead)
        rewind = any(name in STATEFUL_ROLES for name in dead)
        if rewind:
            self.rewind()
        # The actor holds the weights of progress.step when its updates were done or after a
        # rewind (to the checkpoint's step); otherwise those of the step before, as the
        # failed step will be retried.
        self.resync(self.progress.step if rewind or updated else self.progress.step - 1)
        return rewind

    def rewind(self) -> None:
        """Training state was lost: every trainer and the coordinator go back to the last
        checkpoint, or to the very start (re-initialized from the model) without one."""
        if self.ahead is not None:  # its prompts belong to the history left behind
            self.ahead.forget()
        folder = self.checkpoints.rewind_folder()
        if folder is None:
            log.warning("no checkpoint yet: restarting the run from step 0")
            self.servers.initialize([n for n in STATEFUL_ROLES if n in self.servers.named()])
            self.progress.restart(self.cfg)
            return
        self.checkpoints.load(folder)
