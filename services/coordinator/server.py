"""gRPC glue of the coordinator service: protos <-> run_types, status codes, health.

The logic lives in ``run_manager.py``. A bad config -> INVALID_ARGUMENT naming the key; an
unknown run id -> NOT_FOUND; a run that would share busy role servers or a busy run folder
-> FAILED_PRECONDITION.

    python -m services.coordinator.server --host 127.0.0.1 --port 50050 --workdir /checkpoints
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

import grpc

from meshrl.api.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from meshrl.rpc.address import host_port
from meshrl.rpc.metrics_port import add_metrics_port_argument, use_metrics_port
from meshrl.rpc.server import (
    GrpcServer,
    ServiceError,
    rpc_method,
    serve_exit_code,
    wait_for_stop_signal,
)
from meshrl.version import package_version
from services.coordinator.convert import event_to_proto, status_to_proto
from services.coordinator.run.run_manager import RunConflict, RunManager, UnknownRun

log = logging.getLogger(__name__)

SERVICE_NAME = "meshrl.api.v1.CoordinatorService"


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, manager: RunManager):
        self.manager = manager
        self.closing = False
        # Held by StartRun and by close(): a run is either accepted before the service
        # begins to shut down (and then stopped by it) or refused, never started behind it.
        self._starting = threading.Lock()

    def close(self) -> None:
        """From now on StartRun answers UNAVAILABLE."""
        with self._starting:
            self.closing = True

    def _run_call(self, fn, *args):
        try:
            return fn(*args)
        except UnknownRun as e:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"no run {e.args[0]!r} on this coordinator"
            ) from None
        except RunConflict as e:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None

    @rpc_method
    def GetInfo(self, request, context):
        return common_pb2.ServerInfo(
            api_version="meshrl.api.v1",
            service="coordinator",
            weight_version=-1,
            world_size=1,
            ready=True,
            meshrl_version=package_version(),
        )

    @rpc_method
    def StartRun(self, request, context):
        with self._starting:
            if self.closing:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down: no new runs"
                )
            status = self._run_call(
                self.manager.start, request.config_yaml, list(request.overrides)
            )
        return status_to_proto(status)

    def WatchRun(self, request, context):
        # A server stream: the id is checked before the first event, where the status code
        # can still be set; afterwards the stream ends when the run does or the client leaves.
        try:
            events = self.manager.watch(request.run_id, keep_going=context.is_active)
        except UnknownRun:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no run {request.run_id!r} on this coordinator"
            )
        for event in events:
            yield event_to_proto(event)

    @rpc_method
    def StopRun(self, request, context):
        return status_to_proto(self._run_call(self.manager.stop, request.run_id))

    @rpc_method
    def AddRolloutReplica(self, request, context):
        address = _replica_address(request.address)
        return status_to_proto(self._run_call(self.manager.add_replica, request.run_id, address))

    @rpc_method
    def RemoveRolloutReplica(self, request, context):
        address = _replica_address(request.address)
        return status_to_proto(self._run_call(self.manager.remove_replica, request.run_id, address))

    @rpc_method
    def ListRuns(self, request, context):
        return coordinator_pb2.ListRunsResponse(
            runs=[status_to_proto(s) for s in self.manager.list()]
        )


def _replica_address(address: str) -> str:
    """A rollout server's host:port, or INVALID_ARGUMENT saying what is wrong with it."""
    try:
        return host_port(address)
    except argparse.ArgumentTypeError as e:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"rollout server {e}") from None


def serve(host: str = "127.0.0.1", port: int = 50050, workdir: str = ".") -> None:
    """Runs the coordinator until SIGTERM/SIGINT; live runs are stopped on the way out."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars suit a terminal, not a service log
    manager = RunManager(Path(workdir))
    servicer = CoordinatorServicer(manager)
    server = GrpcServer(
        SERVICE_NAME, host, port, max_workers=32, name="coordinator service"
    )  # each watcher holds a thread
    server.add(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, servicer)
    server.start()
    server.mark_ready()
    print(
        f"coordinator ready on {host}:{server.port} (run folders under {Path(workdir).resolve()})",
        flush=True,
    )
    try:
        wait_for_stop_signal()
    finally:
        shut_down(server, servicer, manager)


def shut_down(server: GrpcServer, servicer: CoordinatorServicer, manager: RunManager) -> None:
    """Runs first, the server after: while the runs stop, their watchers still get the
    events (`meshrl run --coordinator` prints "STOPPED" and exits 3 instead of losing the
    coordinator mid-stream), and no new run slips in behind the shutdown."""
    servicer.close()
    server.mark_ready(False)
    manager.shutdown()
    server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="meshrl coordinator service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50050)
    parser.add_argument("--workdir", default=".", help="base of relative run folders")
    add_metrics_port_argument(parser)
    args = parser.parse_args(argv)
    use_metrics_port(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve_exit_code(lambda: serve(args.host, args.port, args.workdir))


if __name__ == "__main__":
    sys.exit(main())
