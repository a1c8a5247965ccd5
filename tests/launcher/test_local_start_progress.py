"""The local launcher names the role servers not answering yet while it waits for them."""

from __future__ import annotations

import time

from meshrl import progress_ticker
from meshrl.config import build_config
from meshrl.launcher.local import LocalLauncher


def test_a_slow_start_names_the_servers_still_starting(tmp_path, monkeypatch, caplog):
    """Before: nothing between `started reward` and `role servers up` (7 to 18 s on a
    loaded machine)."""
    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 0.2)  # 10 s in a run
    launcher = LocalLauncher(build_config({}, ["algorithm.adv_estimator=grpo"]), tmp_path)
    slow = {"rollout0": 0.7, "actor": 0.05, "reward": 0.05}  # seconds to answer
    monkeypatch.setattr(
        launcher, "_spawn", lambda proc: launcher.processes.update({proc.name: proc})
    )
    monkeypatch.setattr(launcher, "_wait_until_serving", lambda proc: time.sleep(slow[proc.name]))
    with caplog.at_level("INFO", logger="meshrl.launcher.local"):
        launcher.start()
    lines = [r.getMessage() for r in caplog.records if "not answering yet" in r.getMessage()]
    assert lines[0].startswith("role servers starting: rollout0, actor, reward not answering yet")
    assert lines[0].endswith("s; launcher.startup_timeout_s=120 each)")
