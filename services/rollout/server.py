"""gRPC glue of the rollout service: protos <-> typed objects, status codes, health.

The logic lives in ``worker.py`` (locking, weight syncs) and the engine; this file only
converts messages once at the edge and maps failures to status codes:
not initialized / memory released / no weight group -> FAILED_PRECONDITION, a bad request
-> INVALID_ARGUMENT, a failed weight sync (also one that landed mid-generation, which fails
that Generate) or a server shutting down -> UNAVAILABLE.

A Generate whose caller is gone (cancelled, past its deadline, its process killed) stops
generating at the engine's next check, so an abandoned run does not hold the engine for the
rest of its batch.

    python -m services.rollout.server --host 127.0.0.1 --port 50051

Ctrl-C or SIGTERM stops it in about the gRPC grace period (2 s), exit code 0, even with a
generation in flight: that call is cancelled (UNAVAILABLE) and its generation stops. A call
that cannot be interrupted (a weight sync blocked on its sender) is not waited for. A second
signal while it stops ends it at once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import threading
from collections.abc import Callable

import grpc

from meshrl.api.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from meshrl.config import config_from_yaml
from meshrl.gpus import gpu_names
from meshrl.rpc.call_markers import CallMarkers
from meshrl.rpc.metrics_port import add_metrics_port_argument, use_metrics_port
from meshrl.rpc.out_of_memory import out_of_memory_line
from meshrl.rpc.server import (
    GrpcServer,
    ServiceError,
    StopSignal,
    exit_at_once,
    rpc_method,
    serve_exit_code,
)
from meshrl.version import package_version
from meshrl.weight_sync.group import WeightGroupError
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from meshrl.wire import ragged_from_proto, tensor_to_proto
from services.rollout.convert import generation_to_proto, sampling_from_proto
from services.rollout.engine import GenerationCancelled, MemoryReleasedError, WeightsMixedError
from services.rollout.metrics import count_generation, register, report_weight_version
from services.rollout.worker import (
    NotInitializedError,
    NoWeightGroupError,
    RolloutWorker,
    ShuttingDownError,
    WeightSyncError,
)

log = logging.getLogger(__name__)

SERVICE_NAME = "meshrl.api.v1.RolloutService"
STOP_WAIT_S = 3.0
"""How long a stopping server waits, after the grace, for its cancelled generations to
stop (a round of decode steps: milliseconds on a GPU)."""
API_VERSION = "meshrl.api.v1"


def _status_of(e: Exception) -> grpc.StatusCode | None:
    if isinstance(e, NotInitializedError | MemoryReleasedError | NoWeightGroupError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, WeightSyncError):
        # A manifest naming parameters the model lacks is the caller's error, not an outage.
        if isinstance(e.__cause__, ValueError):
            return grpc.StatusCode.INVALID_ARGUMENT
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, WeightGroupError | ShuttingDownError | WeightsMixedError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(e, GenerationCancelled):
        return grpc.StatusCode.CANCELLED  # its caller is gone: nobody reads this
    return None


_ROLLOUT_ADVICE = [
    "a lower actor_rollout_ref.rollout.gpu_memory_utilization or max_num_seqs",
    "the trainers' param_offload / optimizer_offload (docs/memory.md)",
]


def _out_of_memory(e: BaseException) -> bool:
    """torch's CUDA out-of-memory error, also as the cause of another (vLLM wraps it)."""
    seen: BaseException | None = e
    for _ in range(8):  # a chain of causes is short
        if seen is None:
            return False
        if type(seen).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _rollout_rpc(fn: Callable) -> Callable:
    """rpc_method plus the rollout's own failures mapped to status codes."""

    @rpc_method
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:
            if _out_of_memory(e):  # vLLM's wake_up, a KV cache taken back, a batch
                line = out_of_memory_line("rollout", fn.__name__, e, _ROLLOUT_ADVICE)
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, line) from e
            code = _status_of(e)
            if code is None:
                raise
            raise ServiceError(code, str(e)) from e

    return wrapper


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, worker: RolloutWorker, on_ready: Callable[[], None] = lambda: None):
        self.worker = worker
        self._on_ready = on_ready
        self.markers = CallMarkers("rollout")  # "rpc Generate #k started/finished" log lines
        register()  # the rollout's own metrics: exported by rollout servers alone
        report_weight_version(lambda: worker.engine.weight_version if worker.ready else -1)

    def _info(self) -> common_pb2.ServerInfo:
        ready = self.worker.ready
        engine = self.worker.engine if ready else None
        return common_pb2.ServerInfo(
            api_version=API_VERSION,
            service="rollout",
            model_path=self.worker.model_path,
            weight_version=engine.weight_version if engine else -1,
            world_size=1,
            num_parameters=engine.num_parameters if engine else 0,
            ready=ready,
            meshrl_version=package_version(),
            gpus=gpu_names(engine.device) if engine else [],
        )

    @_rollout_rpc
    def GetInfo(self, request, context):
        return self._info()

    @_rollout_rpc
    def Initialize(self, request: common_pb2.InitializeRequest, context):
        cfg = config_from_yaml(request.config_yaml)
        self.worker.initialize(cfg)
        self._on_ready()
        return common_pb2.InitializeResponse(info=self._info())

    @_rollout_rpc
    def Generate(self, request: rollout_pb2.GenerateRequest, context):
        params = sampling_from_proto(request.sampling)
        prompts = ragged_from_proto(request.prompts)
        # Set when the RPC ends without us: the client cancelled it or went away (a run
        # abandoned, a coordinator killed), its deadline passed, or the server is stopping.
        # The engine then stops instead of holding the engine lock for the rest of the batch.
        cancelled = threading.Event()
        if not context.add_callback(cancelled.set):  # False: the RPC has ended already
            cancelled.set()
        with self.markers.call("Generate"):
            try:
                result = self.worker.generate(prompts, params, cancelled)
            except GenerationCancelled as e:
                log.info("Generate: %s (its RPC ended: the caller left or the server stops)", e)
                raise
        count_generation(
            prompts,
            result.responses,
            result.finish_reasons,
            result.token_versions,
            result.weight_version,
        )
        return generation_to_proto(result)

    @_rollout_rpc
    def ComputeLogProbs(self, request: common_pb2.LogProbsRequest, context):
        prompts = ragged_from_proto(request.batch.prompts)
        responses = ragged_from_proto(request.batch.responses)
        temperature = request.temperature if request.temperature > 0 else 1.0  # 0 = unset
        scores, version = self.worker.score(prompts, responses, temperature, request.with_entropy)
        return common_pb2.LogProbsResponse(
            logprobs=tensor_to_proto(scores.logprobs.values),
            entropy=tensor_to_proto(scores.entropy.values) if scores.entropy is not None else None,
            weight_version=version,
        )

    @_rollout_rpc
    def JoinWeightGroup(self, request: common_pb2.JoinWeightGroupRequest, context):
        group_id = self.worker.join_group(GroupSpec.from_proto(request.spec))
        return common_pb2.JoinWeightGroupResponse(group_id=group_id)

    @_rollout_rpc
    def ReceiveWeights(self, request: common_pb2.WeightManifest, context):
        with self.markers.call("ReceiveWeights"):
            stats = self.worker.receive(WeightManifest.from_proto(request))
        return common_pb2.WeightSyncResult(
            version=stats.version, seconds=stats.seconds, bytes=stats.bytes
        )

    @_rollout_rpc
    def SetMemoryState(self, request: rollout_pb2.MemoryStateRequest, context):
        kv_bytes = self.worker.set_memory(request.release)
        return rollout_pb2.MemoryStateResponse(kv_cache_bytes=kv_bytes)


def serve(host: str = "127.0.0.1", port: int = 0) -> None:
    """Runs the rollout server until SIGTERM/SIGINT; the model loads on Initialize."""
    server = GrpcServer(SERVICE_NAME, host, port, name="rollout server")
    worker = RolloutWorker()
    server.add(
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
        RolloutServicer(worker, on_ready=server.mark_ready),
    )
    stop = StopSignal()
    server.start()
    try:
        stop.wait()
        log.info("stopping (a second Ctrl-C / SIGTERM exits at once)")
    finally:
        shut_down(server, worker)


def shut_down(server: GrpcServer, worker: RolloutWorker) -> None:
    """Refuses new calls, gives those running the gRPC grace period, then leaves.

    A call still running after the grace has its RPC cancelled (UNAVAILABLE). A generation
    then stops at the engine's next check (within a round of decode steps). A weight sync
    blocked on its sender, a model load or a scoring pass cannot be interrupted, and the
    interpreter would join its thread at exit: a sync waited for the group's timeout. Their
    results have no caller left: after `STOP_WAIT_S` the process exits without them.
    """
    worker.close()
    server.stop()
    running = worker.wait_for_generations(STOP_WAIT_S)
    if running == 0:
        return  # a normal exit: atexit handlers run (an engine's worker processes close)
    log.warning("exiting without waiting for %d rollout call(s) still running", running)
    exit_at_once()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="meshrl rollout server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (logged)")
    add_metrics_port_argument(parser)
    args = parser.parse_args(argv)
    use_metrics_port(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve_exit_code(lambda: serve(args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
