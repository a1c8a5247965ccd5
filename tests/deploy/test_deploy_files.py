"""The deploy files read as text, no Docker engine: deploy/compose.yaml with compose's
defaults filled in, the Dockerfile's final stages, the build scripts, and the paths
docs/deploy.md names. The smoke test (test_compose_smoke.py) runs them for real."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from meshrl.rpc.security import ENV_VARS
from services.coordinator.run.run_manager import RunManager

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


def with_defaults(value):
    """A compose value with every ${VAR:-default} replaced by its default (an unset shell)."""
    if isinstance(value, str):
        return DEFAULT.sub(lambda m: m.group(2), value)
    if isinstance(value, list):
        return [with_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: with_defaults(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


def servers(services: dict) -> dict:
    return {name: s for name, s in services.items() if "healthcheck" in s}


def listens_on(service: dict) -> tuple[str, str]:
    command = with_defaults(service["command"])
    return command[command.index("--host") + 1], command[command.index("--port") + 1]


def seconds(duration: str) -> float:
    return sum(float(n) * {"s": 1, "m": 60}[u] for n, u in re.findall(r"(\d+)([sm])", duration))


def test_each_health_check_probes_the_port_its_server_listens_on(services):
    for name, service in servers(services).items():
        listens = ":".join(listens_on(service))
        probe = with_defaults(service["healthcheck"]["test"])
        assert probe[-1] == listens and "meshrl.rpc.probe" in probe, name


def test_every_container_gets_the_tls_and_token_settings_and_their_folder(services):
    # Without them a server would run without the token the user set for the host CLI.
    for name, service in services.items():
        assert set(ENV_VARS.values()) <= set(service["environment"]), name
        secrets = [v for v in service["volumes"] if "MESHRL_SECRETS" in v]
        assert secrets and secrets[0].endswith(":ro"), name


def test_the_demo_reaches_the_coordinator_and_the_roles_on_their_ports(services):
    env = with_defaults(services["demo"]["environment"])
    ports = {
        name.removesuffix("-cpu"): listens_on(s)[1]
        for name, s in servers(services).items()
        if s.get("profiles", ["cpu"]) == ["cpu"]
    }
    assert env["MESHRL_COORDINATOR"].endswith(":" + ports.pop("coordinator"))
    for role, port in ports.items():
        assert env[f"MESHRL_{role.upper()}_PORT"] == port, role
    assert set(services["demo"]["depends_on"]) == set(servers(services)) - {
        "rollout",
        "actor",
        "critic",
        "ref",
    }


def test_the_coordinator_has_time_to_stop_its_runs_before_docker_kills_it(services):
    grace = inspect.signature(RunManager.shutdown).parameters["grace_s"].default
    # the runs' grace, then up to 10 s for their launchers, then the server's own stop
    assert seconds(services["coordinator"]["stop_grace_period"]) > grace + 10 + 2


def test_gpu_roles_reserve_a_gpu_each_by_default(services):
    ids = [
        with_defaults(s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])[0]
        for s in services.values()
        if s.get("profiles") == ["gpu"]
    ]
    assert sorted(ids) == ["0", "1", "2", "3"]


def stages(dockerfile: str) -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined)."""
    text = re.sub(r"\\\n", " ", dockerfile)
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"FROM \S+ AS (\S+)", line):
            current = out.setdefault(m.group(1), [])
        elif line and not line.startswith("#") and current is not None:
            current.append(line)
    return out


def test_the_images_run_as_an_unprivileged_user_with_no_fetching_at_run_time():
    by_stage = stages((DEPLOY / "Dockerfile").read_text())
    for target in ("cpu", "cuda"):
        users = [line.split()[1] for line in by_stage[target] if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), target
    env = " ".join(line for line in by_stage["runtime"] if line.startswith("ENV "))
    for setting in ("HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1"):
        assert setting in env


def test_the_cpu_wheelhouse_is_pinned_to_the_hosts_versions():
    script = (DEPLOY / "scripts" / "build_wheelhouse.sh").read_text()
    assert "pip freeze" in script and '-c "$CONSTRAINTS"' in script


@pytest.mark.parametrize("script", sorted((DEPLOY / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_stop_at_the_first_error(script):
    head = script.read_text().splitlines()[:15]
    assert head[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in head


def test_every_deploy_path_the_docs_name_exists():
    docs = (REPO / "docs" / "deploy.md").read_text()
    named = set(re.findall(r"`(deploy/[\w./-]+?)`", docs))
    named |= set(re.findall(r"(?<![\w/.])(deploy/(?:scripts/)?[\w-]+\.(?:sh|py|yaml))", docs))
    assert named, "docs/deploy.md names deploy files"
    # deploy/.build/ is what the image build writes (its wheelhouse, dist): not in a clone
    sources = [p for p in sorted(named) if not p.startswith("deploy/.build")]
    assert [p for p in sources if not (REPO / p).exists()] == []
