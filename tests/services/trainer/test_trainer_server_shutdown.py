"""Ctrl-C / SIGTERM to a trainer server as a real process (one rank, or two under torchrun)
with a long call in flight: it stops within a few seconds (the gRPC grace period, 2 s, then
the exit), cancels the call and leaves no rank running.

Before, the server waited for the call: 42 s for a scoring pass of 60k rows of the tiny model
on a CPU, the group's timeout (60 s) for a weight-group join whose rollouts never came, and
under torchrun until torchrun SIGKILLed rank 0 after its 30 s shutdown timeout; a Ctrl-C
broke rank 1 off a command with a KeyboardInterrupt, failing the call INTERNAL. The bound
leaves room for a loaded machine (4.6 s measured with two busy processes on two cores).
"""

import os
import re
import signal
import subprocess
import time

import grpc
import pytest
import torch
from trainer_helpers import TrainerProcess, batch_to_proto, trainer_config

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.ragged import Ragged
from meshrl.wire import tensor_to_proto
from services.trainer.types import SequenceBatch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STOP_BOUND_S = 20.0
# Rows of a call far longer than the bound on any machine (on one core here: about 2 minutes
# to score them, over 20 to update on them), and cheap to build and send (13 MB).
LONG_ROWS = 200_000


def _long_batch(rows: int = LONG_ROWS) -> SequenceBatch:
    """``rows`` copies of one 5-token prompt and one 7-token response."""

    def repeated(row: list[int]) -> Ragged:
        values = torch.tensor(row, dtype=torch.int32).repeat(rows)
        return Ragged(values, torch.arange(0, len(row) * rows + 1, len(row)))

    return SequenceBatch(repeated([4, 5, 6, 7, 8]), repeated([9, 10, 11, 12, 13, 14, 15]))


def _wait_for_log(srv: TrainerProcess, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in srv.log():
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the server log:\n{srv.log()}")
        time.sleep(0.05)


def _stop(
    srv: TrainerProcess, sig: signal.Signals, whole_session: bool
) -> tuple[int | None, float]:
    """Sends ``sig`` to the server (to every process of its session: a terminal's Ctrl-C, or
    the local launcher's stop); returns its exit code (None: still running after
    STOP_BOUND_S) and the seconds until no process of the session was left."""
    start = time.monotonic()
    if whole_session:
        os.killpg(srv.proc.pid, sig)
    else:
        srv.proc.send_signal(sig)
    try:
        rc = srv.proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start
    while time.monotonic() - start < STOP_BOUND_S:
        try:
            os.killpg(srv.proc.pid, 0)  # is a rank of the session still running?
        except ProcessLookupError:
            break
        time.sleep(0.05)
    return rc, time.monotonic() - start


def _assert_cancelled(call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call.result(timeout=30)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@pytest.fixture
def start_server(tmp_path, tiny_model_dir):
    """Starts an actor server of ``ranks`` ranks, initialized with the tiny model; stopped
    (killed if need be) at the end. Once it has answered Initialize every rank waits for
    signals: one sent just after it listens could still meet Python's default handler."""
    servers = []

    def start(ranks: int) -> TrainerProcess:
        srv = TrainerProcess("actor", ranks, tmp_path / f"actor_{len(servers)}.log")
        servers.append(srv)
        srv.wait_ready().initialize(trainer_config(tiny_model_dir))
        return srv

    yield start
    for srv in servers:
        srv.stop()


def _open_group(srv: TrainerProcess, timeout_s: float = 120) -> common_pb2.WeightGroupSpec:
    """A weight group for the actor and one rollout that never joins."""
    request = common_pb2.WeightGroupSpec(transport="gloo", world_size=2, timeout_s=timeout_s)
    return srv.stub.OpenWeightGroup(request, timeout=30)


def _join_in_flight(srv: TrainerProcess):
    """A JoinWeightGroup call the server has started, waiting for a rollout that never
    comes (the group's timeout far past the stop bound)."""
    call = srv.stub.JoinWeightGroup.future(
        common_pb2.JoinWeightGroupRequest(spec=_open_group(srv)), timeout=600
    )
    _wait_for_log(srv, "rpc JoinWeightGroup #1 started")
    return call


def test_ctrl_c_stops_an_idle_trainer_with_exit_code_0(start_server):
    srv = start_server(1)
    rc, seconds = _stop(srv, signal.SIGINT, whole_session=False)
    assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, srv.log())


def test_ctrl_c_does_not_wait_for_an_update_in_flight(start_server):
    srv = start_server(1)
    batch = _long_batch()
    tokens = batch.num_response_tokens
    request = trainer_pb2.PolicyUpdateRequest(
        batch=batch_to_proto(batch),
        old_logprobs=tensor_to_proto(torch.full((tokens,), -3.0)),
        advantages=tensor_to_proto(torch.ones(tokens)),
        global_step=1,
    )
    call = srv.stub.UpdatePolicy.future(request, timeout=600)
    _wait_for_log(srv, "rpc UpdatePolicy #1 started")
    rc, seconds = _stop(srv, signal.SIGINT, whole_session=False)
    log = srv.log()
    assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, log)
    assert "exiting without waiting for 1 trainer call(s) still running" in log
    _assert_cancelled(call)


def test_ctrl_c_does_not_wait_for_a_weight_group_join_whose_rollout_never_comes(start_server):
    srv = start_server(1)
    call = _join_in_flight(srv)
    rc, seconds = _stop(srv, signal.SIGINT, whole_session=False)
    assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, srv.log())
    _assert_cancelled(call)


def test_ctrl_c_stops_every_rank_with_a_scoring_pass_in_flight(start_server):
    # Both ranks are inside the command: rank 0 leaves after its grace without finishing it,
    # and rank 1, signalled too, leaves as rank 0's connections drop.
    srv = start_server(2)
    request = common_pb2.LogProbsRequest(batch=batch_to_proto(_long_batch()))
    call = srv.stub.ComputeLogProbs.future(request, timeout=600)
    _wait_for_log(srv, "rpc ComputeLogProbs #1 started")
    rc, seconds = _stop(srv, signal.SIGINT, whole_session=True)  # as a terminal's Ctrl-C
    log = srv.log()
    assert rc is not None and seconds < STOP_BOUND_S, (rc, seconds, log)
    assert "Unable to shutdown process" not in log  # torchrun had to SIGKILL no rank
    # Rank 1 stopped (seeing rank 0 leave, or at its own bound), not crashed.
    assert re.search(r"trainer\[actor:1\] (INFO|WARNING) \S+: stopping", log), log
    _assert_cancelled(call)


def test_sigterm_stops_every_rank_with_a_weight_group_join_in_flight(start_server):
    # The join runs on rank 0 alone: rank 1 waits for the next command and is released.
    srv = start_server(2)
    call = _join_in_flight(srv)
    rc, seconds = _stop(srv, signal.SIGTERM, whole_session=True)  # as the local launcher
    log = srv.log()
    assert rc is not None and seconds < STOP_BOUND_S, (rc, seconds, log)
    assert "Unable to shutdown process" not in log
    _assert_cancelled(call)
