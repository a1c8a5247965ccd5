"""The coordinator service's per-run event log: every watcher sees the events in order, and
the log holds only the newest ones."""

from __future__ import annotations

import threading

from services.coordinator.run.run_manager import EventLog
from services.coordinator.types import RunEvent, RunState, RunStatus


def _event(step: int, state: RunState = RunState.RUNNING) -> RunEvent:
    return RunEvent(RunStatus("r", state, step=step), {"step": float(step)}, f"step {step}")


def test_a_late_watcher_sees_the_newest_events_then_the_rest():
    log = EventLog(keep=3)
    for step in range(1, 6):
        log.append(_event(step))
    seen = []
    follower = threading.Thread(target=lambda: seen.extend(e.status.step for e in log.follow()))
    follower.start()
    log.append(_event(6, RunState.SUCCEEDED), close=True)
    follower.join(timeout=10)
    assert not follower.is_alive()
    assert seen == [3, 4, 5, 6]  # 1 and 2 were dropped before it joined; nothing repeated


def test_an_early_watcher_sees_every_event_in_order():
    log = EventLog(keep=1000)
    seen = []
    follower = threading.Thread(target=lambda: seen.extend(e.status.step for e in log.follow()))
    follower.start()
    for step in range(1, 50):
        log.append(_event(step))
    log.append(_event(50, RunState.SUCCEEDED), close=True)
    follower.join(timeout=10)
    assert seen == list(range(1, 51))
