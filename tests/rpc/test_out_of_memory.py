"""A CUDA out-of-memory error inside a role is one line naming the role and the phase, not
a retry (docs/memory.md): the trainer and rollout servers answer RESOURCE_EXHAUSTED with it,
and the client's message carries it without the gRPC size-limit hint."""

import grpc
import pytest
import torch

from meshrl.api.v1 import trainer_pb2
from meshrl.rpc.out_of_memory import OUT_OF_MEMORY, out_of_memory_line
from meshrl.rpc.role_client import RoleCallError
from meshrl.rpc.server import ServiceError
from services.rollout.server import _out_of_memory
from services.trainer.rank_handlers import RankHandlers
from services.trainer.server import TrainerServicer

TORCH_SAYS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 112.00 MiB is free.\nIncluding non-PyTorch memory, this process has ..."
)


def test_the_line_names_role_call_phase_and_what_to_change():
    line = out_of_memory_line(
        "critic", "UpdateValue", torch.OutOfMemoryError(TORCH_SAYS), ["critic.param_offload=true"]
    )
    assert line == (
        "out of GPU memory: critic during UpdateValue (update_critic): CUDA out of memory. "
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 112.00 "
        "MiB is free.; to fit, set critic.param_offload=true"
    )


class _OneRank:
    """The command channel of a one-rank trainer."""

    def send(self, method_id, payload):
        pass

    def failed_ranks(self, ok):
        return [] if ok else [0]


def test_the_trainer_server_answers_resource_exhausted_with_that_line(monkeypatch):
    handlers = RankHandlers("actor", "127.0.0.1")

    def out_of_memory(name, request):
        raise torch.OutOfMemoryError(TORCH_SAYS)

    monkeypatch.setattr(handlers, "run", out_of_memory)
    servicer = TrainerServicer(handlers, _OneRank(), server=None)
    with pytest.raises(ServiceError) as failed:
        servicer._run_on_every_rank("UpdatePolicy", trainer_pb2.PolicyUpdateRequest())
    assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(failed.value).startswith(
        f"{OUT_OF_MEMORY}: actor during UpdatePolicy (update_actor)"
    )


class _RpcError(grpc.RpcError):
    def __init__(self, details):
        self._details = details

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return self._details


def test_the_client_says_it_as_it_is_and_keeps_the_size_hint_for_size_limits():
    line = f"{OUT_OF_MEMORY}: actor during UpdatePolicy (update_actor): CUDA out of memory."
    err = RoleCallError("trainer", "127.0.0.1:5", "UpdatePolicy", _RpcError(line))
    assert str(err).endswith(line) and "gRPC size limit" not in str(err)
    too_big = RoleCallError("trainer", "127.0.0.1:5", "UpdatePolicy", _RpcError("too large"))
    assert "gRPC size limit" in str(too_big)


def test_the_rollout_finds_the_error_behind_an_engine_wrapping_it():
    try:
        try:
            raise torch.OutOfMemoryError(TORCH_SAYS)
        except torch.OutOfMemoryError as e:
            raise RuntimeError("wake_up failed") from e
    except RuntimeError as wrapped:
        assert _out_of_memory(wrapped)
    assert not _out_of_memory(RuntimeError("something else"))
