"""The coordinator service shutting down (SIGTERM, `docker stop`) while a client follows a
run: the run is stopped first and its watcher hears it, then the server goes. The service
runs in this process with stand-ins for the launcher and PPO: no role server starts."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from meshrl.api.v1 import coordinator_pb2_grpc
from meshrl.rpc.server import GrpcServer
from meshrl_app.remote import submit
from services.coordinator.client import CoordinatorClient, CoordinatorError
from services.coordinator.run.run_manager import RunManager
from services.coordinator.server import SERVICE_NAME, CoordinatorServicer, shut_down

RUN_YAML = (
    "algorithm: {adv_estimator: grpo}\ntrainer: {logger: [], plot: false}\n"
    "data: {train_files: [never_read.parquet]}\n"  # every run names its training files
    "actor_rollout_ref: {model: {path: never_read}}\n"  # and its model
)


class FakeLauncher:
    def start(self):
        return "fake endpoints"

    def stop(self):
        pass


class FakePPO:
    """Logs a step every 50 ms until stopped (PPORun checks for a stop between steps)."""

    def __init__(self, cfg, endpoints, run_dir, sinks, restarter):
        self.sinks, self.total_steps = sinks, 10_000
        self.progress = SimpleNamespace(step=0)
        self.checkpoints = SimpleNamespace(resumed_from=None)  # a fresh run
        self.stopped = threading.Event()

    def setup(self, data=None):
        pass

    @property
    def finished(self):
        return self.progress.step >= self.total_steps

    def stop(self):
        self.stopped.set()

    def train(self):
        while self.progress.step < self.total_steps and not self.stopped.is_set():
            time.sleep(0.05)
            self.progress.step += 1
            for sink in self.sinks:
                sink.log(self.progress.step, {"critic/score/mean": 0.5})

    def close(self, error=None):
        pass


def serve(workdir, ppo_class):
    """A coordinator service in this process over the stand-in launcher and ``ppo_class``."""
    # no data is read: the stand-in PPO draws no prompts
    manager = RunManager(
        workdir, lambda cfg, run_dir: FakeLauncher(), ppo_class, load_data=lambda cfg, run_dir: None
    )
    servicer = CoordinatorServicer(manager)
    server = GrpcServer(SERVICE_NAME, "127.0.0.1", 0)
    server.add(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, servicer)
    server.start()
    return server, servicer, manager


@pytest.fixture
def service(tmp_path):
    server, servicer, manager = serve(tmp_path, FakePPO)
    yield server, servicer, manager
    server.stop(0)


def test_a_follower_hears_its_run_stopped_when_the_service_shuts_down(service, tmp_path):
    server, servicer, manager = service
    config = tmp_path / "run.yaml"
    config.write_text(RUN_YAML)
    lines: list[str] = []

    def shut_down_at_step_3():
        while not any(line.startswith("step 3:") for line in lines):
            time.sleep(0.02)
        shut_down(server, servicer, manager)

    threading.Thread(target=shut_down_at_step_3, daemon=True).start()
    rc = submit(f"127.0.0.1:{server.port}", str(config), [], write=lines.append)
    assert rc == 3, lines[-3:]  # stopped: not "coordinator unreachable" (2)
    assert "STOPPED" in lines[-1], lines[-3:]


def test_no_run_starts_once_the_service_is_closing(service):
    server, servicer, manager = service
    servicer.close()
    client = CoordinatorClient(f"127.0.0.1:{server.port}")
    try:
        with pytest.raises(CoordinatorError) as err:
            client.start_run(RUN_YAML, [])
    finally:
        client.close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in err.value.details
    assert manager.list() == []


class ResumingPPO(FakePPO):
    """Resolves the run's resume checkpoint in setup, as PPORun does."""

    def __init__(self, cfg, endpoints, run_dir, sinks, restarter):
        super().__init__(cfg, endpoints, run_dir, sinks, restarter)
        self.cfg, self.run_dir = cfg, run_dir

    def setup(self, data=None):
        from services.coordinator.recovery.checkpointing import CheckpointManager
        from services.coordinator.recovery.run_checkpoints import resume_folder

        resume_folder(self.cfg, CheckpointManager(self.run_dir))


def test_a_run_whose_resume_checkpoint_does_not_verify_is_rejected_exit_2(tmp_path):
    server, _, _ = serve(tmp_path, ResumingPPO)
    try:
        config = tmp_path / "run.yaml"
        config.write_text(RUN_YAML)
        lines: list[str] = []
        missing = tmp_path / "nope" / "global_step_5"
        rc = submit(
            f"127.0.0.1:{server.port}",
            str(config),
            [f"trainer.resume_mode={missing}"],
            write=lines.append,
        )
    finally:
        server.stop(0)
    assert rc == 2, lines[-3:]  # the request is wrong, as a local run says
    assert "REJECTED" in lines[-1] and "trainer.resume_mode" in lines[-1]
    assert f"{missing}: no such folder" in lines[-1]
