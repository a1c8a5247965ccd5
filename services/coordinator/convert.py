"""Coordinator protos <-> the run's typed status and events (``types.py``)."""

from __future__ import annotations

from typing import cast

from meshrl.api.v1 import coordinator_pb2
from services.coordinator.types import RunEvent, RunState, RunStatus


def status_to_proto(s: RunStatus) -> coordinator_pb2.RunStatus:
    return coordinator_pb2.RunStatus(
        run_id=s.run_id,
        state=cast(coordinator_pb2.RunState, s.state.value),  # the enums share their numbers
        step=s.step,
        total_steps=s.total_steps,
        message=s.message,
        run_dir=s.run_dir,
    )


def event_to_proto(e: RunEvent) -> coordinator_pb2.RunEvent:
    return coordinator_pb2.RunEvent(
        status=status_to_proto(e.status), metrics=e.metrics, log_line=e.log_line
    )


def status_from_proto(s: coordinator_pb2.RunStatus) -> RunStatus:
    return RunStatus(s.run_id, RunState(s.state), s.step, s.total_steps, s.message, s.run_dir)


def event_from_proto(e: coordinator_pb2.RunEvent) -> RunEvent:
    return RunEvent(status_from_proto(e.status), dict(e.metrics), e.log_line)
