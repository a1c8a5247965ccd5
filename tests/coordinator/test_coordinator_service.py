"""The coordinator as a service: a real `services.coordinator.server` process, runs submitted
through the CLI (`meshrl run --coordinator`) and the gRPC client, with the local launcher
(role servers as its subprocesses) and the external one (servers this test started)."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest
from coordinator_helpers import REPO, ServerProcess, tiny_run_yaml

from meshrl.api.v1 import coordinator_pb2, coordinator_pb2_grpc
from meshrl.rpc.client import open_channel
from meshrl.testing.processes import role_server_pids
from meshrl_app import remote
from services.coordinator.client import CoordinatorClient, CoordinatorError
from services.coordinator.types import RunState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("coordinator")
    server = ServerProcess(
        "services.coordinator.server", workdir / "coordinator.log", "--workdir", str(workdir)
    )
    yield server
    server.stop()
    assert not server.alive()


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshrl_app.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_key_fails_at_start_naming_it(coordinator, tmp_path):
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(open_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRun(
            coordinator_pb2.StartRunRequest(config_yaml="trainer:\n  total_training_step: 3\n"),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trainer.total_training_step: unknown config key" in err.value.details()

    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batch_size: 4\n")
    out = cli(
        "run",
        "--coordinator",
        coordinator.address,
        str(bad),
        "actor_rollout_ref.actor.clip_ratio=abc",
    )
    assert out.returncode == 2, out.stderr
    assert "actor_rollout_ref.actor.clip_ratio" in out.stderr


def test_external_launcher_needs_the_roles_addresses(coordinator):
    client = CoordinatorClient(coordinator.address)
    with pytest.raises(CoordinatorError) as err:
        client.start_run(
            "launcher:\n  kind: external\n  addresses: {rollout: ['127.0.0.1:1']}\n", []
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "launcher.addresses.actor" in err.value.details


def test_unknown_run_is_not_found(coordinator):
    client = CoordinatorClient(coordinator.address)
    with pytest.raises(CoordinatorError) as err:
        client.stop_run("no-such-run")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(CoordinatorError) as err:
        list(client.watch("no-such-run"))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert client.info().service == "coordinator"


@pytest.mark.slow
def test_cli_submits_and_follows_a_local_run(coordinator, tiny_model, arithmetic_data, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(tiny_run_yaml(tiny_model, arithmetic_data, tmp_path / "run", steps=2))
    out = cli(
        "run", "--coordinator", coordinator.address, str(config), "trainer.experiment_name=local"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("step 1: score=") for line in lines), out.stdout
    assert any(line.startswith("step 2: score=") for line in lines), out.stdout
    assert lines[-1].endswith("SUCCEEDED step 2/2"), out.stdout
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2

    status = cli("status", "--coordinator", coordinator.address)
    assert status.returncode == 0
    row = next(line for line in status.stdout.splitlines() if line.startswith("local-"))
    assert "SUCCEEDED" in row and "2/2" in row
    assert not role_server_pids(coordinator.proc.pid), "the local launcher stopped its servers"


@pytest.mark.slow
def test_external_servers_conflict_stop_and_ctrl_c(
    coordinator, tiny_model, arithmetic_data, tmp_path
):
    servers = {}
    try:
        for role, module, extra in (
            ("rollout", "services.rollout.server", ()),
            ("actor", "services.trainer.server", ("--role", "actor")),
            ("reward", "services.reward.server", ("--num-workers", "1")),
        ):
            servers[role] = ServerProcess(module, tmp_path / f"{role}.log", *extra)
        external = ["launcher.kind=external"] + [
            f"launcher.addresses.{r}=[{s.address}]" for r, s in servers.items()
        ]
        config = tmp_path / "run.yaml"
        config.write_text(tiny_run_yaml(tiny_model, arithmetic_data, tmp_path / "run", steps=500))

        # the CLI follows the run; Ctrl-C makes it ask StopRun and wait for the end
        follower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshrl_app.cli",
                "run",
                "--coordinator",
                coordinator.address,
                str(config),
                "trainer.experiment_name=ext",
                *external,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen = []
        try:
            for line in follower.stdout:
                seen.append(line)
                if line.startswith("step 2:"):
                    break
            client = CoordinatorClient(coordinator.address)
            # the same servers, while the first run holds them
            with pytest.raises(CoordinatorError) as err:
                client.start_run(
                    config.read_text().replace(str(tmp_path / "run"), str(tmp_path / "other")),
                    external,
                )
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "role servers" in err.value.details

            follower.send_signal(signal.SIGINT)
            rest, _ = follower.communicate(timeout=120)
        finally:
            if follower.poll() is None:
                follower.kill()
        out = "".join(seen) + rest
        assert follower.returncode == 3, out
        assert "stopping run ext-" in out
        assert "STOPPED" in out.splitlines()[-1]
        run = next(r for r in client.list_runs() if r.run_id.startswith("ext-"))
        assert run.state is RunState.STOPPED and 2 <= run.step < 500
        assert all(s.alive() for s in servers.values()), (
            "external servers are not the coordinator's to stop"
        )

        # the same servers take the next run; `meshrl stop` from another client ends it
        status = client.start_run(config.read_text(), [*external, "trainer.experiment_name=again"])
        events = client.watch(status.run_id)
        said: list[str] = []
        for event in events:
            if event.status.step >= 1:
                assert remote.stop(coordinator.address, status.run_id, said.append) == 0
                break
        final = [e.status for e in events][-1]
        assert final.state is RunState.STOPPED
        assert said[0].startswith(
            f"stop requested; it ends after its current step: run {status.run_id}"
        )
        remote.stop(coordinator.address, status.run_id, said.append)
        assert said[1].startswith(f"nothing to stop: run {status.run_id} STOPPED")
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.slow
def test_external_server_that_dies_is_waited_for_and_reinitialized(
    coordinator, tiny_model, arithmetic_data, tmp_path
):
    """As with compose's `restart: unless-stopped`: the rollout server dies mid-run and its
    supervisor (here the test) starts it again on the same port; the run waits for it,
    initializes it, syncs the weights again and goes on."""
    servers = {}
    try:
        for role, module, extra in (
            ("rollout", "services.rollout.server", ()),
            ("actor", "services.trainer.server", ("--role", "actor")),
            ("reward", "services.reward.server", ("--num-workers", "1")),
        ):
            servers[role] = ServerProcess(module, tmp_path / f"{role}.log", *extra)
        overrides = ["launcher.kind=external", "trainer.experiment_name=revive"]
        overrides += [f"launcher.addresses.{r}=[{s.address}]" for r, s in servers.items()]
        config = tiny_run_yaml(tiny_model, arithmetic_data, tmp_path / "run", steps=8)
        client = CoordinatorClient(coordinator.address)
        status = client.start_run(config, overrides)
        lines = []
        for event in client.watch(status.run_id):
            lines.append(event.log_line)
            if event.status.step == 2 and "rollout2" not in servers:
                old = servers.pop("rollout")
                old.stop(grace_s=0)  # killed at once
                servers["rollout2"] = ServerProcess(
                    "services.rollout.server", tmp_path / "rollout.log", port=old.port
                )
            final = event.status
        assert final.state is RunState.SUCCEEDED, "\n".join(lines)
        assert final.step == 8
        assert any("restarting" in line or "recovering" in line for line in lines), "\n".join(lines)
    finally:
        for server in servers.values():
            server.stop()
