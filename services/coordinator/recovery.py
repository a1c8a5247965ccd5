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
from typing import Protocol

from meshrl.rpc.client import unreachable

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
    """Role servers whose process exited, else those that no longer answer health checks."""
    dead = restarter.dead_roles()
    return dead or [name for name, address in addresses.items() if unreachable(address)]
