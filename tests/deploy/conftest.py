"""Fixtures of the deploy tests: a private Docker engine and the CPU image built in it.

Both are session-scoped: the engine starts once (and stops at the end), the image is
built once, for the compose smoke test and the testcontainers test alike. Without a way
to run Docker here the tests skip, saying why; under CI (``CI=true``) they fail instead, so
that a green CI run is one that ran them.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from docker_engine import DockerEngine, DockerUnavailable, docker_unavailable

REPO = Path(__file__).resolve().parents[2]
IMAGE = "meshrl:cpu"


@pytest.fixture(scope="session")
def docker_engine():
    engine = DockerEngine()
    start = time.perf_counter()
    try:
        engine.start()
    except DockerUnavailable as e:
        docker_unavailable(str(e))
    print(f"\ndockerd ({engine.driver}) up in {time.perf_counter() - start:.0f}s")
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def cpu_image(docker_engine) -> str:
    """deploy/scripts/build_images.sh cpu: debootstrap base, host wheelhouse, image."""
    start = time.perf_counter()
    out = subprocess.run(
        ["bash", str(REPO / "deploy/scripts/build_images.sh"), "cpu"],
        cwd=REPO,
        env=docker_engine.env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if out.returncode != 0:
        raise RuntimeError(f"image build failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    docker_engine.docker("image", "prune", "-f")  # our own engine: old layers of earlier builds
    print(f"\n{IMAGE} built in {time.perf_counter() - start:.0f}s")
    return IMAGE
