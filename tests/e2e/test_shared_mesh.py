"""The shared role servers come back when one dies, so a test that breaks one does not fail
every later run on them."""

from __future__ import annotations

import os
import signal

from meshrl.rpc.client import wait_for_health
from tests.e2e.shared_mesh import revive


def test_a_dead_shared_server_is_started_again_and_the_section_follows(shared_launcher):
    launcher, section = shared_launcher
    reward = launcher.processes["reward"]
    os.killpg(reward.popen.pid, signal.SIGKILL)
    reward.popen.wait(timeout=10)
    assert launcher.dead_roles() == ["reward"]

    assert revive(launcher, section) == ["reward"]

    assert launcher.dead_roles() == []
    assert section["addresses"]["reward"] == [reward.address]
    wait_for_health(reward.address, timeout_s=10)
    assert revive(launcher, section) == []  # nothing dead: nothing restarted
