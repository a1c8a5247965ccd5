"""benchmarks/ppo/gpu_memory.py names each GPU process's role from its command line (a
forked server's title) or the environment it started with; the phase from the coordinator's
calls in flight."""

import subprocess
import sys
import time

from benchmarks.ppo.gpu_memory import phase_of, role_of


def _role(pid: int) -> str | None:
    """role_of once the child's command line is there (it may still be exec'ing)."""
    for _ in range(100):
        if (role := role_of(pid)) is not None:
            return role
        time.sleep(0.05)
    return None


def test_a_server_title_names_its_role():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(30)",
            "services.trainer.server",
            "--role",
            "critic",
        ]
    )
    try:
        assert _role(proc.pid) == "critic"
    finally:
        proc.kill()
    rollout = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "-m", "services.rollout.server"]
    )
    try:
        assert _role(rollout.pid) == "rollout"
    finally:
        rollout.kill()


def test_the_phase_is_the_step_part_in_flight():
    assert phase_of([("actor", "UpdatePolicy"), ("critic", "ComputeValues")]) == "update_actor"
    assert phase_of([("rollout", "Generate")]) == "generate"
    assert phase_of([("ref", "ComputeLogProbs"), ("critic", "ComputeValues")]) == "infer"
    assert phase_of([]) == "other"
