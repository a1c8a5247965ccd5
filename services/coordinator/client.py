"""The coordinator service's typed client: start, watch, stop and list runs, and change a
run's rollout pool."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import grpc

from meshrl.api.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from meshrl.config import ConfigError
from meshrl.rpc.address import host_port
from meshrl.rpc.client import open_channel
from services.coordinator.convert import event_from_proto, status_from_proto
from services.coordinator.types import RunEvent, RunStatus

DEFAULT_ADDRESS = "127.0.0.1:50050"


def default_address() -> str:
    """$MESHRL_COORDINATOR, checked as --coordinator is (ConfigError naming it), or the
    default."""
    address = os.environ.get("MESHRL_COORDINATOR", DEFAULT_ADDRESS)
    try:
        return host_port(address)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"$MESHRL_COORDINATOR {e}") from None


class CoordinatorError(RuntimeError):
    """A call to the coordinator failed; `code` is the gRPC status code."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        # UNAVAILABLE is also the service's own answer ("shutting down"): only a connection
        # that failed is nothing listening there.
        unreachable = code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (
            details.lower()
        )
        what = "unreachable" if unreachable else code.name
        message = f"coordinator at {address}: {what}: {details}"
        if code == grpc.StatusCode.UNIMPLEMENTED:  # something answers, but not this service
            message += (
                " (a gRPC server answers there, but it is no meshrl coordinator service: a "
                "role or reward server? Start one with `meshrl serve coordinator`)"
            )
        elif unreachable:
            message += (
                " (start one with `meshrl serve coordinator`, or name another with "
                "--coordinator or $MESHRL_COORDINATOR; `meshrl run CONFIG` without "
                "--coordinator runs here, with no service)"
            )
        super().__init__(message)

    @classmethod
    def of(cls, address: str, err: grpc.RpcError) -> CoordinatorError:
        return cls(address, err.code(), err.details())


class CoordinatorClient:
    def __init__(self, address: str, timeout_s: float = 30.0):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def _call(self, method: str, request):
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise CoordinatorError.of(self.address, e) from None

    def info(self) -> common_pb2.ServerInfo:
        return self._call("GetInfo", common_pb2.GetInfoRequest())

    def start_run(self, config_yaml: str, overrides: list[str]) -> RunStatus:
        req = coordinator_pb2.StartRunRequest(config_yaml=config_yaml, overrides=overrides)
        return status_from_proto(self._call("StartRun", req))

    def stop_run(self, run_id: str) -> RunStatus:
        return status_from_proto(
            self._call("StopRun", coordinator_pb2.StopRunRequest(run_id=run_id))
        )

    def add_rollout_replica(self, run_id: str, address: str) -> RunStatus:
        """The rollout server at ``address`` joins the run's pool at its next step."""
        req = coordinator_pb2.RolloutReplicaRequest(run_id=run_id, address=address)
        return status_from_proto(self._call("AddRolloutReplica", req))

    def remove_rollout_replica(self, run_id: str, address: str) -> RunStatus:
        """The rollout replica at ``address`` leaves the run's pool at its next step."""
        req = coordinator_pb2.RolloutReplicaRequest(run_id=run_id, address=address)
        return status_from_proto(self._call("RemoveRolloutReplica", req))

    def list_runs(self) -> list[RunStatus]:
        return [
            status_from_proto(s)
            for s in self._call("ListRuns", coordinator_pb2.ListRunsRequest()).runs
        ]

    def watch(self, run_id: str) -> Iterator[RunEvent]:
        """Every event of the run from its start; ends when the run does. No deadline."""
        stream = self.stub.WatchRun(coordinator_pb2.WatchRunRequest(run_id=run_id))
        try:
            for event in stream:
                yield event_from_proto(event)
        except grpc.RpcError as e:
            raise CoordinatorError.of(self.address, e) from None
        finally:
            stream.cancel()

    def close(self) -> None:
        self.channel.close()
