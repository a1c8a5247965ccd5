"""Where the host and the GPU are at each named point of a step, without the profiler.

The profiler slows the host (it records every op), so a host-bound step looks worse under
it than it is. This records, at chosen points, the host's clock and a CUDA event, and after
one synchronisation reports for each point when the host reached it and when the GPU did
(both in ms from the step's start). Where the GPU reaches a point barely after the host
queued it, the GPU was waiting for the host there.

Points are the ``record_function`` ranges of the given modules (their enter and exit) and
forward hooks on given submodules.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class Timeline:
    """Host times and CUDA events of named points, in the order they were reached."""

    names: list[str] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    events: list[torch.cuda.Event | None] = field(default_factory=list)

    def mark(self, name: str) -> None:
        event = None
        if torch.cuda.is_available():  # without a GPU: host times only
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.names.append(name)
        self.host_s.append(time.perf_counter())
        self.events.append(event)

    def report(self) -> list[dict]:
        """One row per point: host and GPU time from the first point, and the GPU's lag
        behind the host (small lag: the GPU had nothing queued, it waited for the host)."""
        if not self.names:
            return []
        first = self.events[0]
        if first is not None:
            torch.cuda.synchronize()
        rows = []
        for name, host, event in zip(self.names, self.host_s, self.events, strict=True):
            row = {"point": name, "host_ms": round((host - self.host_s[0]) * 1e3, 3)}
            if first is not None:
                row["gpu_ms"] = round(first.elapsed_time(event), 3)
                row["lag_ms"] = round(row["gpu_ms"] - row["host_ms"], 3)
            rows.append(row)
        return rows


@contextlib.contextmanager
def timed_ranges(
    timeline: Timeline, modules: list, hooked: dict[str, torch.nn.Module] | None = None
) -> Iterator[Timeline]:
    """Marks the enter and exit of every ``record_function`` range opened by ``modules``
    (each module's own ``record_function`` name is swapped for the block), and the start
    and end of each ``hooked`` submodule's forward. Everything is put back after."""

    @contextlib.contextmanager
    def marked(name: str, *args, **kwargs) -> Iterator[None]:
        timeline.mark(f"{name} >")
        try:
            yield
        finally:
            timeline.mark(f"{name} <")

    saved = [(m, m.record_function) for m in modules]
    handles = []
    for label, module in (hooked or {}).items():
        handles.append(
            module.register_forward_pre_hook(
                lambda *_, label=label: timeline.mark(f"{label} >"), prepend=True
            )
        )
        handles.append(
            module.register_forward_hook(lambda *_, label=label: timeline.mark(f"{label} <"))
        )
    try:
        for m in modules:
            m.record_function = marked
        yield timeline
    finally:
        for m, original in saved:
            m.record_function = original
        for h in handles:
            h.remove()


def wait_for_quiet_children(
    timeout_s: float = 60.0, quiet_s: float = 1.0, poll_s: float = 0.25
) -> float:
    """Waits until this process's child processes (torch.compile's worker pool, which
    starts after the first compile and keeps every core busy for seconds) have used under
    a tenth of a core for ``quiet_s``; returns the seconds waited (at most ``timeout_s``).
    Linux only (reads /proc); elsewhere returns 0 at once."""
    if not os.path.exists("/proc/self/task"):
        return 0.0
    start = time.monotonic()
    quiet_since = start
    last = _children_cpu_s()
    while time.monotonic() - start < timeout_s:
        time.sleep(poll_s)
        now = _children_cpu_s()
        if now - last > 0.1 * poll_s:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
        last = now
    return time.monotonic() - start


def _children_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's direct children."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total
