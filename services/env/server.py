"""Environment server: gRPC glue around the episode table (``episodes.py``).

    python -m services.env.server --port 50056 [--tool-workers 2] [--tool-timeout-s 5]

Ready (health SERVING) once its sandbox workers are up; observations are text alone until
Initialize loads the run's tokenizer, after which they also carry its token ids.
Initialize applies the run's ``multi_turn.tool_timeout_s`` and ``step_timeout_s`` and
drops the episodes still open; the sandbox's workers and their memory limit are the
process's own (``--tool-workers``, ``--tool-memory-limit-mb``: the local launcher passes
the run's ``multi_turn`` values).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from meshrl.api.v1 import common_pb2, env_pb2, env_pb2_grpc
from meshrl.config.loader import ConfigError, config_from_yaml
from meshrl.config.roles import role_settings
from meshrl.rpc.metrics_port import use_metrics_port
from meshrl.rpc.server import GrpcServer, StopSignal, rpc_method, serve_exit_code
from services.env.convert import (
    action_from_proto,
    result_to_proto,
    spec_to_proto,
    started_to_proto,
    task_from_proto,
)
from services.env.episodes import EpisodeTable
from services.env.registry import build_environments
from services.env.sandbox import Sandbox
from services.env.tokenizer import load_encoder

log = logging.getLogger(__name__)

SERVICE_NAME = "meshrl.api.v1.EnvService"


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, sandbox: Sandbox, tool_timeout_s: float, step_timeout_s: float):
        self.sandbox = sandbox
        self.table = EpisodeTable(build_environments(sandbox, tool_timeout_s), None, step_timeout_s)
        self.model_path = ""
        self._lock = threading.Lock()  # Initialize swaps the table

    def info(self) -> common_pb2.ServerInfo:
        return common_pb2.ServerInfo(
            api_version="meshrl.api.v1",
            service="env",
            model_path=self.model_path,
            weight_version=-1,
            world_size=1,
            ready=True,
        )

    @rpc_method
    def GetInfo(self, request, context):
        return self.info()

    @rpc_method
    def Initialize(self, request, context):
        cfg = config_from_yaml(request.config_yaml)  # ConfigError is a ValueError
        settings = role_settings(cfg, "env")
        mt, path = settings.section, settings.tokenizer_path
        encode = load_encoder(path)
        table = EpisodeTable(
            build_environments(self.sandbox, mt.tool_timeout_s), encode, mt.step_timeout_s
        )
        with self._lock:
            old, self.table, self.model_path = self.table, table, path
        old.shutdown()
        log.info("initialized: tokenizer of %s, %s", path, mt.model_dump())
        return common_pb2.InitializeResponse(info=self.info())

    @rpc_method
    def ListEnvironments(self, request, context):
        specs = [spec_to_proto(s) for s in self.table.specs()]
        return env_pb2.ListEnvironmentsResponse(environments=specs)

    @rpc_method
    def Reset(self, request, context):
        tasks = [task_from_proto(m) for m in request.tasks]
        started = self.table.reset(tasks)  # UnknownEnvironment is a ValueError
        return env_pb2.ResetResponse(episodes=[started_to_proto(s) for s in started])

    @rpc_method
    def Step(self, request, context):
        actions = [action_from_proto(m) for m in request.actions]
        results = self.table.step(actions, request.timeout_s or None)
        return env_pb2.StepResponse(results=[result_to_proto(r) for r in results])

    @rpc_method
    def Close(self, request, context):
        return env_pb2.CloseResponse(closed=self.table.close(list(request.episode_ids)))


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tool_workers: int = 2,
    tool_timeout_s: float = 5.0,
    tool_memory_limit_mb: int = 512,
    step_timeout_s: float = 30.0,
) -> None:
    """Runs the environment server until SIGTERM/SIGINT."""
    stop = StopSignal()
    sandbox = Sandbox(tool_workers, tool_memory_limit_mb)
    server = GrpcServer(SERVICE_NAME, host, port, name="env server")
    servicer = EnvServicer(sandbox, tool_timeout_s, step_timeout_s)
    server.add(env_pb2_grpc.add_EnvServiceServicer_to_server, servicer)
    try:
        server.start()
        server.mark_ready()
        print(f"env server ready on {host}:{server.port}", flush=True)
        stop.wait()
        log.info("stopping")
    finally:
        server.stop()
        servicer.table.shutdown()
        sandbox.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.env.server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tool-workers", type=int, default=2, help="sandbox worker processes")
    p.add_argument("--tool-timeout-s", type=float, default=5.0, help="limit of one tool call")
    p.add_argument("--tool-memory-limit-mb", type=int, default=512, help="per sandbox worker")
    p.add_argument("--step-timeout-s", type=float, default=30.0, help="limit of one step")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    use_metrics_port(args)
    return serve_exit_code(
        lambda: serve(
            args.host,
            args.port,
            tool_workers=args.tool_workers,
            tool_timeout_s=args.tool_timeout_s,
            tool_memory_limit_mb=args.tool_memory_limit_mb,
            step_timeout_s=args.step_timeout_s,
        ),
        ConfigError,
    )


if __name__ == "__main__":
    sys.exit(main())
