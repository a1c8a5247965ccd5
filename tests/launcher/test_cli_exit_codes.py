"""`meshrl run`'s exit codes, the same with or without --coordinator: 0 succeeded, 1 the run
failed, 2 the request is wrong, 3 stopped (after its checkpoint)."""

from __future__ import annotations

import grpc
import pytest

import meshrl.launcher.run_local as run_local_module
from meshrl import cli
from meshrl.launcher.run_local import RunResult
from services.coordinator.checkpointing import CheckpointError
from services.coordinator.clients import RoleCallError


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("{}\n")
    return str(path)


def _run_ends_with(monkeypatch, outcome):
    def fake_run_local(cfg):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(run_local_module, "run_local", fake_run_local)


def test_a_finished_run_exits_0(monkeypatch, config):
    _run_ends_with(monkeypatch, RunResult({"critic/score/mean": 0.5}, finished=True))
    assert cli.main(["run", config]) == cli.EXIT_SUCCEEDED == 0


def test_a_stopped_run_exits_3_as_through_the_coordinator(monkeypatch, config):
    _run_ends_with(monkeypatch, RunResult({"critic/score/mean": 0.5}, finished=False))
    assert cli.main(["run", config]) == cli.EXIT_STOPPED == 3


@pytest.mark.parametrize(
    "error",
    [
        RoleCallError("actor", "127.0.0.1:2", "Update", Unavailable()),
        CheckpointError("could not write the checkpoint of step 4: No space left on device"),
    ],
)
def test_a_failed_run_exits_1_not_as_a_bad_config(monkeypatch, config, capsys, error):
    _run_ends_with(monkeypatch, error)
    assert cli.main(["run", config]) == cli.EXIT_FAILED == 1
    assert str(error) in capsys.readouterr().err


def test_run_result_is_the_last_metrics():
    result = RunResult({"a": 1.0}, finished=True)
    assert result == {"a": 1.0} and result["a"] == 1.0 and result.finished
