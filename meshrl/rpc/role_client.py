"""What every role server's typed client shares: a channel, a deadline on every call, and
errors that name the server and the call.

A failed call raises :class:`RoleCallError` naming the service, its address and what it was
doing, so a dead server reads as "rollout at 127.0.0.1:5301 failed during Generate:
UNAVAILABLE ..." rather than a bare gRPC traceback.
"""

from __future__ import annotations

from typing import Any

import grpc

from meshrl.api.v1 import common_pb2
from meshrl.rpc.calls_in_flight import CALLS_IN_FLIGHT
from meshrl.rpc.client import open_channel
from meshrl.rpc.options import message_limit
from meshrl.rpc.out_of_memory import OUT_OF_MEMORY
from meshrl.weight_sync.types import GroupSpec


class RoleCallError(RuntimeError):
    """An RPC to a role server failed; the message names the server and the call.
    ``code``: the gRPC status code; ``code_name``: its name, for callers that need no grpc."""

    def __init__(self, service: str, address: str, method: str, err: grpc.RpcError):
        self.service, self.address, self.method = service, address, method
        self.code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        self.details = details
        code = self.code_name = self.code.name if self.code is not None else "ERROR"
        hint = ""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not details.startswith(
            OUT_OF_MEMORY
        ):
            hint = (
                f" (a message over a gRPC size limit, {message_limit() >> 20} MiB in this "
                "process: lower data.train_batch_size (data.gen_batch_size) or rollout.n, or raise "
                "MESHRL_GRPC_MAX_MESSAGE_MB on every process of the run)"
            )
        super().__init__(f"{service} at {address} failed during {method}: {code}: {details}{hint}")


class RoleClient:
    """Base of the role servers' clients; a subclass sets ``service`` and ``stub``."""

    service = "role"
    stub: Any

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address)

    def _call(self, method: str, request, timeout_s: float | None = None):
        try:
            with CALLS_IN_FLIGHT.track(self.service, self.address, method):  # progress lines
                return getattr(self.stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise RoleCallError(self.service, self.address, method, e) from None

    def info(self) -> common_pb2.ServerInfo:
        return self._call("GetInfo", common_pb2.GetInfoRequest(), timeout_s=10)

    def initialize(self, config_yaml: str, run_dir: str = "") -> common_pb2.ServerInfo:
        req = common_pb2.InitializeRequest(config_yaml=config_yaml, run_dir=run_dir)
        return self._call("Initialize", req).info

    def join_weight_group(self, spec: GroupSpec) -> str:
        req = common_pb2.JoinWeightGroupRequest(spec=spec.to_proto())
        return self._call("JoinWeightGroup", req, timeout_s=spec.timeout_s + 10).group_id

    def close(self) -> None:
        self.channel.close()
