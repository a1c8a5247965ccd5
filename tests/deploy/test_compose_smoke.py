"""The compose smoke test: Debian's Docker engine, the CPU image built without a registry,
`docker-compose --profile cpu up` of deploy/compose.yaml (one container per role, the
coordinator, and the one-shot demo that prepares data + model and submits the run through
the CLI), then a second run submitted from the host CLI to the coordinator container.
Everything is torn down at the end (compose down -v, then the engine stops).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrl.launcher.ports import free_port

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
ROLES = ("coordinator", "rollout", "actor", "critic", "ref", "reward")
DEMO_OVERRIDES = (
    "trainer.total_training_steps=3 trainer.test_freq=-1 trainer.val_before_train=false"
)


@pytest.fixture
def compose(docker_engine, cpu_image, tmp_path):
    """The cpu profile up (-d), on free ports; yields (run compose, env); always down -v."""
    env = {
        **docker_engine.env,
        "COMPOSE_PROJECT_NAME": f"meshrlsmoke{os.getpid()}",
        "MESHRL_DEMO_OVERRIDES": DEMO_OVERRIDES,
        "MESHRL_DEMO_WARM_START": "0",  # a smoke test: the run, not the learning
        "MESHRL_REWARD_WORKERS": "1",
        **{f"MESHRL_{role.upper()}_PORT": str(free_port()) for role in ROLES},
    }

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker-compose", "-f", str(COMPOSE_FILE), "--profile", "cpu", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    try:
        yield run, env
    finally:
        down = run("down", "-v", "-t", "10", timeout=900)
        print(f"compose down: rc {down.returncode}")


def test_compose_cpu_profile_runs_the_demo_and_takes_runs_from_the_host(
    compose, docker_engine, tmp_path
):
    run, env = compose
    timings = {}
    start = time.perf_counter()
    up = run("up", "-d")
    if up.returncode != 0:
        # Seen once in a session's run (2026-12-03), not again in the next: `up` gave up 18 s
        # in, a dependency of the demo "unhealthy" well inside its 120 s start period. What
        # each container said is printed, then `up` is asked once more; a second failure
        # fails the test with both accounts.
        first = up.stdout + up.stderr + containers_report(run, docker_engine)
        print(f"compose up failed once; retrying:\n{first}")
        up = run("up", "-d")
        assert up.returncode == 0, first + up.stdout + up.stderr
    timings["up (healthy)"] = time.perf_counter() - start
    # every role container up and healthy, as the report of a failed `up` would show them
    assert containers_report(run, docker_engine).count('"Health":{"Status":"healthy"') >= len(
        ROLES
    ), containers_report(run, docker_engine)

    # the demo container: prepare, submit with `meshrl run --coordinator`, follow to the end
    # by its id: v1 and v2 name containers differently
    demo = run("ps", "-q", "demo").stdout.strip()
    assert demo, run("ps").stdout
    waited = docker_engine.docker("wait", demo, timeout=900)
    timings["demo run"] = time.perf_counter() - start - timings["up (healthy)"]
    logs = docker_engine.docker("logs", demo).stdout + docker_engine.docker("logs", demo).stderr
    assert waited.stdout.strip() == "0", logs
    for step in (1, 2, 3):
        assert f"step {step}: score=" in logs, logs
    assert "SUCCEEDED step 3/3" in logs, logs
    assert "external launcher" in logs  # the coordinator drove the role containers

    # the host CLI submits to the coordinator container; paths are the containers' own
    config = tmp_path / "run.yaml"
    config.write_text(run("exec", "-T", "coordinator", "cat", "/data/demo/run.yaml").stdout)
    address = f"127.0.0.1:{env['MESHRL_COORDINATOR_PORT']}"
    t0 = time.perf_counter()
    host = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrl_app.cli",
            "run",
            "--coordinator",
            address,
            str(config),
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.experiment_name=fromhost",
            "trainer.default_local_dir=/checkpoints/fromhost",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    timings["host run"] = time.perf_counter() - t0
    assert host.returncode == 0, host.stdout + host.stderr
    assert host.stdout.rstrip().endswith("SUCCEEDED step 2/2"), host.stdout

    status = subprocess.run(
        [sys.executable, "-m", "meshrl_app.cli", "status", "--coordinator", address],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.stdout.count("SUCCEEDED") == 2, status.stdout
    # each container's own health, by id: `ps`'s table wraps long names over two lines
    for service in ("coordinator", "reward", "rollout-cpu", "actor-cpu", "critic-cpu", "ref-cpu"):
        container = run("ps", "-q", service).stdout.strip()
        assert container, run("ps").stdout
        health = docker_engine.docker(
            "inspect", "--format", "{{.State.Health.Status}}", container
        ).stdout.strip()
        assert health == "healthy", (service, health, run("ps").stdout)
    print("\n" + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))


def containers_report(run, docker_engine) -> str:
    """Each container of the project: its state, its health log and its last log lines."""
    lines = []
    for cid in run("ps", "-a", "-q").stdout.split():
        state = docker_engine.docker(
            "inspect", "--format", "{{.Name}} {{json .State}}", cid, check=False
        )
        logs = docker_engine.docker("logs", "--tail", "20", cid, check=False)
        lines += [state.stdout.strip(), (logs.stdout + logs.stderr)[-2000:]]
    return "\n".join(lines)
