"""What a run's life tells its user: the line it starts training with, and the calls it
waits on when they last."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from meshrl import progress_ticker
from meshrl.config import build_config
from meshrl.launcher.endpoints import Endpoints
from meshrl.rpc.calls_in_flight import CALLS_IN_FLIGHT
from services.coordinator.run.lifecycle import long_calls_said, start_line


def _ppo(step: int, total: int, resumed_from: str | None = None):
    folder = Path(resumed_from) if resumed_from else None
    return SimpleNamespace(
        progress=SimpleNamespace(step=step),
        total_steps=total,
        checkpoints=SimpleNamespace(resumed_from=folder),
    )


def test_a_resumed_run_says_from_where_and_how_many_steps_are_left():
    """Before: `running 10 PPO steps` for a run resumed with 2 left."""
    cfg = build_config({}, [])
    ppo = _ppo(8, 10, "runs/x/checkpoints/global_step_8")
    assert start_line(cfg, ppo) == (
        "resumed from runs/x/checkpoints/global_step_8 (step 8); running 2 of 10 PPO steps"
    )
    assert start_line(cfg, _ppo(0, 10)) == "running 10 PPO steps"
    evaluation = build_config({}, ["trainer.val_only=true"])
    assert start_line(evaluation, _ppo(8, 0)) == (
        "validating the weights of step 8 (trainer.val_only)"
    )


def test_a_long_call_of_the_run_is_named_every_period_and_a_short_one_never(monkeypatch):
    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 0.3)  # 10 s in a run
    mine = Endpoints(rollout=["h:1"], actor="h:2", reward="h:3")
    ppo = SimpleNamespace(servers=SimpleNamespace(endpoints=mine))
    said: list[str] = []
    release = threading.Event()

    def call(server, address, method, seconds=None):
        with CALLS_IN_FLIGHT.track(server, address, method):
            release.wait(seconds)

    with long_calls_said(ppo, said.append):
        calls = [
            threading.Thread(target=call, args=("actor", "h:2", "Initialize")),
            threading.Thread(target=call, args=("rollout", "h:9", "Generate")),  # another run's
            threading.Thread(target=call, args=("reward", "h:3", "Score", 0.05)),  # quick
        ]
        for t in calls:
            t.start()
        time.sleep(2.0)
        release.set()
        for t in calls:
            t.join()
    assert said, "the long call is named"
    assert all(line.startswith("still waiting: actor Initialize (") for line in said)
    assert len(said) >= 4  # at its marks 0.3 s, 0.6 s, ... of the 2 s it lasted
