"""Without Docker the Docker tests skip on a workstation and fail under CI."""

import pytest
from docker_engine import docker_unavailable


def test_without_docker_a_workstation_skips(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Docker cannot run here: no dockerd"):
        docker_unavailable("no dockerd")


@pytest.mark.parametrize("value", ["true", "True"])
def test_without_docker_ci_fails(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(
        pytest.fail.Exception, match="CI=true requires the Docker tests: no dockerd"
    ):
        docker_unavailable("no dockerd")
