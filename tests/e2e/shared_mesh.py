"""The shared role servers' `launcher` section, and starting their dead ones again (for
``conftest.py``'s ``shared_mesh``)."""

from __future__ import annotations

from meshrl.launcher.local import LocalLauncher


def launcher_section(launcher: LocalLauncher) -> dict:
    """The `launcher` config section (`kind: external`) that points a run at ``launcher``'s
    role servers, as they are now."""
    e = launcher.endpoints()
    addresses = dict(rollout=e.rollout, actor=[e.actor], critic=[e.critic], ref=[e.ref])
    return {"kind": "external", "addresses": {**addresses, "reward": [e.reward]}}


def revive(launcher: LocalLauncher, section: dict) -> list[str]:
    """Starts ``launcher``'s dead role servers again and points ``section`` (in place, so
    configs built from it later see it) at where they serve now; returns their names."""
    dead = launcher.dead_roles()
    for name in dead:
        launcher.restart(name)
    if dead:
        section.update(launcher_section(launcher))
    return dead
