"""The reward service image on its own, through testcontainers: start the container, wait
for its gRPC health, score GSM8k and MATH answers from the host, and let testcontainers
remove the container."""

from __future__ import annotations

import pytest

from meshrl.launcher.ports import free_port
from meshrl.rpc.client import wait_for_health
from services.reward.client import RewardClient
from services.reward.server import SERVICE_NAME
from services.reward.types import ScoreItem

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]


def test_reward_image_scores_over_grpc(docker_engine, cpu_image, monkeypatch):
    for key in ("DOCKER_HOST", "TESTCONTAINERS_RYUK_DISABLED"):
        monkeypatch.setenv(key, docker_engine.env[key])
    testcontainers = pytest.importorskip("testcontainers.core.container")
    from testcontainers.core.config import testcontainers_config

    # Ryuk, the reaper, is an image from a registry; the context manager removes ours.
    monkeypatch.setattr(testcontainers_config, "ryuk_disabled", True)
    port = free_port()
    container = testcontainers.DockerContainer(
        cpu_image,
        command=f"meshrl reward serve --host 127.0.0.1 --port {port} --num-workers 1",
        network_mode="host",  # the engine runs with --bridge=none: host networking only
    )
    with container:
        address = f"127.0.0.1:{port}"
        wait_for_health(address, SERVICE_NAME, timeout_s=180)  # SERVING once the scorers are up
        with RewardClient(address, timeout_s=60) as client:
            assert client.info().service == "reward"
            outcomes = client.score(
                [
                    ScoreItem("openai/gsm8k", "5 + 7 = 12 #### 12", "12"),
                    ScoreItem("openai/gsm8k", "5 + 7 = 13 #### 13", "12"),
                    ScoreItem(
                        "DigitalLearningGmbH/MATH-lighteval",
                        "so the answer is $\\boxed{\\frac{1}{2}}$",
                        "\\frac{1}{2}",
                    ),
                ]
            )
        logs = container.get_logs()
    assert [o.score for o in outcomes] == [1.0, 0.0, 1.0], (outcomes, logs)
    assert all(o.ok for o in outcomes)
