"""Device memory of each role server per phase of a run, sampled while it runs.

A thread polls ``nvidia-smi`` for every process's GPU memory (what the process holds:
its caching allocator's reserve, CUDA context included), maps each process to its role by
the launcher's ``MESHRL_INSTANCE_ID`` in its environment (``actor-3f2a...``; vLLM's engine
process inherits its server's), and files the sample under the phase of the step that the
coordinator's calls in flight name (memory_plan's phases). Per phase: each role's largest
figure and the largest total.
"""

from __future__ import annotations

import subprocess
import threading
from collections import defaultdict
from pathlib import Path

from meshrl.rpc.calls_in_flight import CALLS_IN_FLIGHT
from meshrl.rpc.out_of_memory import CALL_PHASES

INSTANCE_ENV = b"MESHRL_INSTANCE_ID="


def phase_of(methods: list[tuple[str, str]]) -> str:
    """The memory plan's phase for the coordinator's calls in flight."""
    phases = {CALL_PHASES.get(m) for _, m in methods} - {None}
    for phase in ("update_actor", "update_critic", "generate", "infer", "sync"):
        if phase in phases:
            return phase
    return "other"


def role_of(pid: int) -> str | None:
    """The role of a server process: from its command line (a forked server's title, set by
    setproctitle to its command: ``... services.trainer.server --role actor ...``), else
    from the environment it started with (a spawned server's MESHRL_INSTANCE_ID; a forked
    one shows its fork server's start-up environment there)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if "--role" in words[:-1]:
        return words[words.index("--role") + 1]
    for word in words:
        if word.startswith("services.") and word.endswith(".server"):
            return word.split(".")[1]  # services.rollout.server -> rollout
    for item in environ:
        if item.startswith(INSTANCE_ENV):
            name = item[len(INSTANCE_ENV) :].decode().rsplit("-", 1)[0]
            return name.rstrip("0123456789") or name  # rollout0 -> rollout
    return None


def gpu_processes() -> list[tuple[int, int]]:
    """(pid, MiB) of every process on the GPUs."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        if pid.isdigit() and mib.isdigit():
            rows.append((int(pid), int(mib)))
    return rows


class MemorySampler:
    """``with MemorySampler() as s: run(); s.report()``."""

    def __init__(self, every_s: float = 0.2):
        self.every_s = every_s
        self.roles: dict[str, dict[str, int]] = defaultdict(dict)  # phase -> role -> MiB
        self.totals: dict[str, int] = defaultdict(int)  # phase -> MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.samples = 0

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _loop(self) -> None:
        names: dict[int, str | None] = {}
        while not self._stop.wait(self.every_s):
            try:
                rows = gpu_processes()
            except (OSError, subprocess.SubprocessError):
                return
            phase = phase_of(CALLS_IN_FLIGHT.methods())
            by_role: dict[str, int] = defaultdict(int)
            for pid, mib in rows:
                if pid not in names:
                    names[pid] = role_of(pid)
                by_role[names[pid] or "other"] += mib
            for role, mib in by_role.items():
                self.roles[phase][role] = max(self.roles[phase].get(role, 0), mib)
            self.totals[phase] = max(self.totals[phase], sum(by_role.values()))
            self.samples += 1

    def report(self) -> dict:
        """Per phase, GiB: each role's peak and the peak total (the largest at one time)."""
        return {
            phase: {
                "total_gib": round(self.totals[phase] / 1024, 2),
                "roles_gib": {r: round(m / 1024, 2) for r, m in sorted(roles.items())},
            }
            for phase, roles in self.roles.items()
        } | {"samples": self.samples}
