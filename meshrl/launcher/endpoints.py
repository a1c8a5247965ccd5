"""Where a run's role servers listen: what every launcher returns and the coordinator
connects to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Endpoints:
    """host:port of each role server of a run."""

    rollout: list[str]
    actor: str
    reward: str
    critic: str | None = None
    ref: str | None = None
    env: str | None = None  # the environment server of a multi-turn run

    @staticmethod
    def from_addresses(addresses: dict[str, str]) -> Endpoints:
        """Launcher names (rollout0, rollout1, actor, critic, ref, reward, env) -> endpoints."""
        return Endpoints(
            rollout=[a for name, a in addresses.items() if name.startswith("rollout")],
            actor=addresses["actor"],
            reward=addresses["reward"],
            critic=addresses.get("critic"),
            ref=addresses.get("ref"),
            env=addresses.get("env"),
        )
