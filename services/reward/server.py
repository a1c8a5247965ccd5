"""Reward server: gRPC glue around RewardScorer.

    python -m services.reward.server --port 50055 [--custom-function f.py:fn] [--reward-model DIR]

Ready (health SERVING) as soon as the rule scorers' workers are up; Initialize applies a run's
``reward`` section (custom function, timeouts, workers, reward model) by building a new scorer
and swapping it in. Score calls run concurrently (up to ``--max-calls``, default 8; their
samples share the worker pool), so a slow batch does not hold up the others.

Ctrl-C or SIGTERM stops it in a few seconds, exit code 0, even with a hung reward function
in flight: that call is cancelled (UNAVAILABLE) after the gRPC grace period (2 s), its
samples are cancelled and the scorer workers ended. A second signal while it stops ends it
at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading

import grpc

from meshrl.api.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from meshrl.config.loader import ConfigError, config_from_yaml
from meshrl.config.roles import role_settings
from meshrl.config.sections import RewardConfig
from meshrl.rpc.call_count import CallCount
from meshrl.rpc.call_markers import CallMarkers
from meshrl.rpc.metrics_port import use_metrics_port
from meshrl.rpc.server import (
    GrpcServer,
    ServiceError,
    StopSignal,
    exit_at_once,
    rpc_method,
    serve_exit_code,
)
from meshrl.version import package_version
from services.reward.arguments import add_serve_arguments, reward_config, reward_model_settings
from services.reward.convert import item_from_proto, outcome_to_proto
from services.reward.scorer_slot import DEFAULT_MAX_CALLS, NotReady, ScorerSlot
from services.reward.scoring import RewardScorer
from services.reward.types import RewardModelError

log = logging.getLogger(__name__)

SERVICE_NAME = "meshrl.api.v1.RewardService"

ABANDON_WAIT_S = 3.0
"""How long a stopping server waits for its Score calls once their samples are cancelled."""


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Answers UNAVAILABLE until its first scorer is in place (see `swap`)."""

    def __init__(self, memory_limit_mb: int | None = None, max_calls: int = DEFAULT_MAX_CALLS):
        self.memory_limit_mb = memory_limit_mb  # the process's setting, kept across Initialize
        self.slot = ScorerSlot(max_calls)  # Score calls borrow it concurrently
        # Initialize builds its scorer (workers, a reward model) before the slot sees it.
        self.initializing = CallCount(
            lambda name: ServiceError(grpc.StatusCode.UNAVAILABLE, "reward server is stopping")
        )
        self.markers = CallMarkers("reward")  # "rpc Score #k started/finished" log lines

    def swap(self, scorer: RewardScorer) -> None:
        """Puts `scorer` in service; the previous one finishes its calls and closes."""
        self.slot.swap(scorer)

    def info(self) -> common_pb2.ServerInfo:
        scorer = self.slot.current
        rm = scorer.reward_model if scorer else None
        return common_pb2.ServerInfo(
            api_version="meshrl.api.v1",
            service="reward",
            model_path=rm.path if rm else "",
            weight_version=-1,
            world_size=1,
            num_parameters=rm.num_parameters if rm else 0,
            ready=scorer is not None,
            meshrl_version=package_version(),
            gpus=rm.gpus if rm else [],
        )

    @rpc_method
    def GetInfo(self, request, context):
        return self.info()

    @rpc_method
    def Initialize(self, request, context):
        cfg = config_from_yaml(request.config_yaml)  # ConfigError is a ValueError: INVALID_ARGUMENT
        reward = role_settings(cfg, "reward").section
        with self.initializing.admit("Initialize"):
            # built aside: Score keeps working meanwhile
            self.swap(RewardScorer(reward, memory_limit_mb=self.memory_limit_mb))
        log.info("initialized: %s", reward.model_dump())
        return common_pb2.InitializeResponse(info=self.info())

    @rpc_method
    def Score(self, request, context):
        items = [item_from_proto(m) for m in request.items]
        try:
            with self.slot.borrow() as scorer, self.markers.call("Score"):
                # A caller that leaves (its deadline passed, it cancelled, it died) takes
                # its samples out of the workers: they would delay other calls' samples.
                outcomes = scorer.score(items, request.timeout_s or None, context.add_callback)
        except NotReady as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        return reward_pb2.ScoreResponse(results=[outcome_to_proto(o) for o in outcomes])

    @rpc_method
    def ListScorers(self, request, context):
        scorer = self.slot.current  # no place needed: the names need no worker
        if scorer is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "reward server is starting its workers")
        return reward_pb2.ListScorersResponse(data_sources=scorer.known_data_sources())

    def abandon(self, timeout_s: float) -> int:
        """Cancels what the running calls still score (they return failed samples now);
        how many calls still run after `timeout_s` (see `ScorerSlot.abandon`), an
        Initialize still building its scorer included (a scorer it builds later is
        abandoned at once)."""
        self.initializing.close()
        return self.slot.abandon(timeout_s) + self.initializing.running


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    custom_function: str | None = None,
    timeout_s: float = 10.0,
    num_workers: int = 2,
    reward_model_path: str | None = None,
    reward_model_settings: dict[str, object] | None = None,
    memory_limit_mb: int | None = None,
    max_calls: int = DEFAULT_MAX_CALLS,
) -> None:
    """Runs the reward server until SIGTERM/SIGINT. `reward_model_settings`: see
    `arguments.reward_config`; `memory_limit_mb` caps each scorer worker's address space (None = 4096);
    `max_calls`: Score calls served at once."""
    with start_up_errors():
        cfg = reward_config(
            custom_function, timeout_s, num_workers, reward_model_path, reward_model_settings
        )
        server = GrpcServer(SERVICE_NAME, host, port, name="reward server")
        servicer = RewardServicer(memory_limit_mb, max_calls)
        server.add(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer)
        stop = StopSignal()  # a Ctrl-C while the workers start is kept, and acted on after
        server.start()  # listening (overall health SERVING) while the workers start
    try:
        with start_up_errors():
            scorer = start_scorer(cfg, memory_limit_mb, stop)
        if scorer is None:  # stopped while starting
            stop.wait()  # returns at once; a second signal now ends the process at once
            return
        servicer.swap(scorer)
        server.mark_ready()
        print(f"reward server ready on {host}:{server.port}", flush=True)
        stop.wait()
        log.info("stopping (a second Ctrl-C / SIGTERM exits at once)")
    finally:
        shut_down(server, servicer)


@contextlib.contextmanager
def start_up_errors():
    """ValueError / OSError of the start-up (the scorer's checks of its config, a custom
    function file that does not exist, a port in use, a reward model folder that cannot be
    read) as a ConfigError: one line, exit 2, instead of a traceback (two, with the scorer
    worker's). Errors of a server already serving are not turned into it. A reward model that
    cannot be loaded is said of --reward-model, which gave its path here (Initialize names
    the config key)."""
    try:
        yield
    except RewardModelError as e:
        raise ConfigError(str(e.naming("--reward-model"))) from None
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None


def start_scorer(
    cfg: RewardConfig, memory_limit_mb: int | None, stop: StopSignal
) -> RewardScorer | None:
    """The first scorer (its workers started, a reward model loaded), or None once a stop
    signal came: the start-up is not waited for then.

    A Ctrl-C at a terminal (or the launcher's SIGTERM) reaches the whole process group, so
    the workers, still starting, die of it too; pebble then either fails the start-up or
    keeps starting new workers. Either is the stop, not a failure of the server."""
    built: list[RewardScorer] = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            built.append(RewardScorer(cfg, memory_limit_mb=memory_limit_mb))
        except BaseException as e:  # noqa: BLE001 - re-raised below unless stopping
            failed.append(e)

    builder = threading.Thread(target=build, name="reward-start", daemon=True)
    builder.start()
    while builder.is_alive() and not stop.received:
        builder.join(StopSignal.POLL_S)
    if not stop.received:
        if failed:
            raise failed[0]
        return built[0]
    if builder.is_alive():
        log.info("stopped while starting its workers")
        exit_at_once()  # the start-up's threads and workers are not joined
    log.info("stopped while starting its workers%s", f" ({failed[0]!r})" if failed else "")
    for scorer in built:
        scorer.abandon()
    return None


def shut_down(server: GrpcServer, servicer: RewardServicer) -> None:
    """Refuses new calls, gives those running the gRPC grace period, then cancels what
    they still score and leaves.

    Before, the server closed its scorer only once the calls that borrowed it had their
    results, so a hung reward function held the process for the sample timeout (38 s with
    `--timeout-s 40`), until `docker compose stop` killed it (`stop_grace_period`, 20 s in
    deploy/compose.yaml). Now the samples still being scored after the grace are cancelled
    and the scorer workers ended, and calls on the reward model stop after their micro-batch
    under way; those calls have already been cancelled (UNAVAILABLE). A micro-batch under
    way, or an Initialize building a scorer, cannot be cut short: after `ABANDON_WAIT_S`
    the process exits without it.
    """
    server.stop()
    running = servicer.abandon(ABANDON_WAIT_S)
    if running:
        log.warning("exiting without waiting for %d call(s) still running", running)
        exit_at_once()


def serve_from_args(args: argparse.Namespace) -> None:
    """`serve` with the arguments of `add_serve_arguments`; ConfigError (exit 2 for both
    commands) when it cannot start as asked (see `start_up_errors`)."""
    use_metrics_port(args)
    serve(
        args.host,
        args.port,
        custom_function=args.custom_function,
        timeout_s=args.timeout_s,
        num_workers=args.num_workers,
        reward_model_path=args.reward_model,
        reward_model_settings=reward_model_settings(args),
        memory_limit_mb=args.memory_limit_mb,
        max_calls=args.max_calls,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.reward.server", description=__doc__.split("\n")[0]
    )
    add_serve_arguments(p, default_port=0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve_exit_code(lambda: serve_from_args(args), ConfigError)


if __name__ == "__main__":
    sys.exit(main())
