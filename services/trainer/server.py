"""gRPC glue of the trainer (roles actor, critic, ref): protos <-> typed objects, status
codes, health, and handing each command from rank 0 to the other ranks.

Run plainly (one rank) or under torchrun (rank 0 serves gRPC, the others follow):

    python -m services.trainer.server --role actor --host 127.0.0.1 --port 50061
    torchrun --nproc_per_node=2 -m services.trainer.server --role actor --port 50061

Ctrl-C or SIGTERM stops every rank within a few seconds (the gRPC grace period, 2 s, then
the processes' exit), each with exit code 0, even with a call in flight (an update, a scoring
pass, a weight-group join or send blocked on its peer): that call is cancelled (UNAVAILABLE)
and not waited for. Run plainly, a second signal while it stops ends it at once; under
torchrun, which forwards each signal it gets to every rank, a rank takes a repeated signal as
the same stop (torchrun itself exits 1 when signalled, whatever its ranks do).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist

from meshrl.api.v1 import common_pb2, trainer_pb2_grpc
from meshrl.config.memory_plan import advice
from meshrl.rpc.call_count import CallCount
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
from meshrl.weight_sync.group import WeightGroupError
from meshrl.weight_sync.types import GroupSpec
from services.trainer.command_channel import CommandChannel, serve_commands
from services.trainer.distributed import init_distributed
from services.trainer.rank_handlers import (
    COMMAND_IDS,
    ROLES,
    SERVED_BY,
    RankHandlers,
)
from services.trainer.weight_publisher import SyncStateError

log = logging.getLogger(__name__)

SERVICE_NAME = "meshrl.api.v1.TrainerService"
# gRPC's grace period for the calls in flight when the server is told to stop.
STOP_GRACE_S = 2.0
# How long a rank other than 0, told to stop, waits for rank 0 to end the command in flight
# and release it (SHUTDOWN), or to leave (its connections then drop): rank 0's grace and a
# margin, below the 5 s the local launcher gives a server before SIGKILL.
FOLLOWER_STOP_S = STOP_GRACE_S + 2.0


def _shutting_down(method: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE, f"{method}: the trainer server is shutting down"
    )


def _counted(fn: Callable) -> Callable:
    """Counts the call in `TrainerServicer.calls` while it runs (inside rpc_method)."""

    @functools.wraps(fn)
    def wrapper(self: TrainerServicer, request, context):
        with self.calls.admit(fn.__name__):
            return fn(self, request, context)

    return wrapper


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Rank 0's gRPC face: checks preconditions, then runs the command on every rank."""

    def __init__(self, handlers: RankHandlers, channel: CommandChannel, server: GrpcServer):
        self.handlers = handlers
        self.channel = channel
        self.server = server
        self._lock = threading.Lock()  # one command at a time through the channel
        self.markers = CallMarkers(handlers.role_name)  # "rpc <Method> #k started/finished"
        self.calls = CallCount(_shutting_down)

    def _check(self, method: str) -> None:
        role = self.handlers.role_name
        served_by = SERVED_BY.get(method)
        if served_by is not None and role not in served_by:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method} is served by role {' or '.join(served_by)}; this server is {role}",
            )
        if self.handlers.role is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method} before Initialize on the {role} server",
            )

    def _run(self, method: str, request):
        """Sends the command to the other ranks, runs it here, and fails if any rank failed."""
        with self._lock:
            # A call that waited for the channel while the server began to stop: the other
            # ranks may already have been released (`release_other_ranks`).
            if self.calls.closing:
                raise _shutting_down(method)
            return self._run_on_every_rank(method, request)

    def _run_on_every_rank(self, method: str, request):
        with self.markers.call(method):
            self.channel.send(COMMAND_IDS[method], request.SerializeToString())
            error: Exception | None = None
            try:
                result = self.handlers.run(method, request)
            except Exception as e:  # noqa: BLE001 - re-raised after the ranks agree
                error = e
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - e.g. torch's CheckpointException
                # Not an Exception: no handler up to gRPC's would answer the call with it.
                error = RuntimeError(f"{type(e).__name__}: {e}")
            failed = [r for r in self.channel.failed_ranks(error is None) if r != 0]
        if isinstance(error, WeightGroupError):
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"weight sync failed: {error}")
        if isinstance(error, SyncStateError):
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        if isinstance(error, torch.OutOfMemoryError):
            # One line naming the role and the phase; no retry would fit better.
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                out_of_memory_line(
                    self.handlers.role_name,
                    method,
                    error,
                    advice(self.handlers.cfg) if self.handlers.cfg is not None else [],
                ),
            )
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{method} failed on rank(s) {failed}; see their logs")
        return result

    def release_other_ranks(self) -> bool:
        """Once stopping: sends SHUTDOWN to the other ranks unless a command holds the channel
        (then they are inside it, with this rank: they leave as its connections drop).
        Returns whether it was sent."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.channel.shutdown()
            return True
        finally:
            self._lock.release()

    @rpc_method
    def GetInfo(self, request, context):
        return self.handlers.info()

    @rpc_method
    @_counted
    def Initialize(self, request, context):
        self.server.mark_ready(False)
        try:
            response = self._run("Initialize", request)
        except Exception:
            self.handlers.role = None  # half-built on some ranks: not ready until a retry works
            raise
        self.server.mark_ready()
        return response

    @rpc_method
    @_counted
    def ComputeLogProbs(self, request, context):
        self._check("ComputeLogProbs")
        return self._run("ComputeLogProbs", request)

    @rpc_method
    @_counted
    def ComputeValues(self, request, context):
        self._check("ComputeValues")
        return self._run("ComputeValues", request)

    @rpc_method
    @_counted
    def UpdatePolicy(self, request, context):
        self._check("UpdatePolicy")
        return self._run("UpdatePolicy", request)

    @rpc_method
    @_counted
    def UpdateValue(self, request, context):
        self._check("UpdateValue")
        return self._run("UpdateValue", request)

    @rpc_method
    @_counted
    def OpenWeightGroup(self, request, context):
        self._check("OpenWeightGroup")
        spec = GroupSpec.from_proto(self._fill_group_defaults(request))
        return self.handlers.publisher.open(spec).to_proto()

    @rpc_method
    @_counted
    def JoinWeightGroup(self, request, context):
        self._check("JoinWeightGroup")
        try:
            # Marked as a long call: it blocks until every rollout joined, up to the timeout.
            with self.markers.call("JoinWeightGroup"):
                group_id = self.handlers.publisher.join(GroupSpec.from_proto(request.spec))
        except WeightGroupError as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except SyncStateError as e:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        return common_pb2.JoinWeightGroupResponse(group_id=group_id)

    @rpc_method
    @_counted
    def PrepareWeights(self, request, context):
        self._check("PrepareWeights")
        return self._run("PrepareWeights", request)

    @rpc_method
    @_counted
    def SendWeights(self, request, context):
        self._check("SendWeights")
        try:
            # Checked here, before the other ranks start gathering for nothing.
            self.handlers.publisher.check_ready(request.version)
        except SyncStateError as e:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        return self._run("SendWeights", request)

    @rpc_method
    @_counted
    def SaveCheckpoint(self, request, context):
        self._check("SaveCheckpoint")
        return self._run("SaveCheckpoint", request)

    @rpc_method
    @_counted
    def LoadCheckpoint(self, request, context):
        self._check("LoadCheckpoint")
        return self._run("LoadCheckpoint", request)

    def _fill_group_defaults(self, msg: common_pb2.WeightGroupSpec) -> common_pb2.WeightGroupSpec:
        """An empty field of OpenWeightGroup's request takes the run config's value."""
        role, publisher = self.handlers.role, self.handlers.publisher
        # OpenWeightGroup: _check passed, so this is the initialised actor (it publishes).
        assert role is not None and publisher is not None
        filled = common_pb2.WeightGroupSpec()
        filled.CopyFrom(msg)
        if filled.transport in ("", "auto"):
            on_gpu = role.world.device.type == "cuda"
            filled.transport = "nccl" if on_gpu else "gloo"
        if filled.timeout_s <= 0:
            filled.timeout_s = publisher.default_timeout_s
        if filled.world_size <= 0:
            filled.world_size = publisher.default_world_size
        return filled


def serve(role: str, host: str = "127.0.0.1", port: int = 0) -> None:
    """Runs one trainer rank; rank 0 serves gRPC until SIGTERM, the others follow it."""
    if role not in ROLES:
        raise ValueError(f"unknown trainer role {role!r}; expected one of {sorted(ROLES)}")
    init_distributed()
    channel = CommandChannel()
    handlers = RankHandlers(role, host)
    if dist.get_rank() != 0:
        follow(channel, handlers)
        return
    server = GrpcServer(SERVICE_NAME, host, port, name=f"{role} trainer server")
    servicer = TrainerServicer(handlers, channel, server)
    server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer)
    stop = StopSignal()
    server.start()
    log.info(
        "trainer %s (%d ranks) serving on %s:%d", role, dist.get_world_size(), host, server.port
    )
    try:
        # torchrun forwards to every rank each signal it gets, so one Ctrl-C at a terminal
        # reaches a rank twice: there a repeated signal is the same stop, and torchrun
        # SIGKILLs the ranks itself after its shutdown timeout (30 s).
        torchrun = _under_torchrun()
        stop.wait(second_exits_at_once=not torchrun)
        log.info("stopping" if torchrun else "stopping (a second Ctrl-C / SIGTERM exits at once)")
    finally:
        shut_down(server, servicer)


def shut_down(server: GrpcServer, servicer: TrainerServicer) -> None:
    """Rank 0: refuses new calls, gives those running the gRPC grace period, releases the
    other ranks, then leaves.

    A call still running after the grace has had its RPC cancelled (UNAVAILABLE) but goes on
    in its handler thread, and the interpreter joins that thread at exit: an update or a
    scoring pass over a large batch held the process for as long as it took (42 s for 60k
    rows of a tiny model on a CPU), a weight-group join waiting for its rollouts for the
    group's timeout (60 s), and closing the weight group waited for that join too; under
    torchrun, until torchrun's own 30 s shutdown timeout and its SIGKILL. Their results have
    no caller left: the process exits without waiting for them. The other ranks, inside the
    same command, see this rank's connections drop; they were signalled too and leave
    (`follow`).
    """
    servicer.calls.close()
    server.stop(STOP_GRACE_S)
    released = servicer.release_other_ranks()
    running = servicer.calls.running
    if running == 0:  # a normal exit: nothing holds the weight group or the world
        if servicer.handlers.publisher is not None:
            servicer.handlers.publisher.close()
        dist.destroy_process_group()
        return
    inside = not released and servicer.channel.world_size > 1
    log.warning(
        "exiting without waiting for %d trainer call(s) still running%s",
        running,
        " (the other ranks are inside one and leave as this rank does)" if inside else "",
    )
    exit_at_once()


def follow(channel: CommandChannel, handlers: RankHandlers) -> None:
    """Ranks other than 0: run rank 0's commands until it sends SHUTDOWN.

    The commands run in a thread of their own, so that this rank can still act on a Ctrl-C
    or SIGTERM: waiting for the next command, or inside one (a collective with rank 0), the
    rank is blocked in C++, where no Python signal handler runs. Before, a SIGINT waited
    there and then broke off whatever ran next with a KeyboardInterrupt (a traceback, exit
    1, and rank 0's call failing INTERNAL while it was still in its grace period); a
    SIGTERM killed the rank at once, with the same effect on rank 0.

    Told to stop, the rank gives rank 0 `FOLLOWER_STOP_S` to end the command in flight and
    release it (SHUTDOWN). A rank 0 that leaves with the command unfinished drops its
    connections, which ends the command here too (gloo); a rank still inside it after that
    time (NCCL notices a dead peer only at its own timeout) leaves without it.
    """
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            serve_commands(channel, handlers.dispatch, stopping=lambda: stop.received)
        except BaseException as e:  # noqa: BLE001 - re-raised (or reported) by the main thread
            failure.append(e)
        finally:
            done.set()

    # Further signals while stopping change nothing: torchrun forwards to every rank each
    # signal it gets, so one Ctrl-C at a terminal reaches a rank twice (StopSignal's
    # handler takes no lock for that reason).
    stop = StopSignal()
    threading.Thread(target=run, name="trainer-commands", daemon=True).start()
    while not stop.received and not done.wait(StopSignal.POLL_S):
        pass
    if stop.received and not done.wait(FOLLOWER_STOP_S):
        log.warning("stopping without waiting for the command still running")
        exit_at_once()
    if failure and stop.received:
        # Rank 0 left with a command unfinished, as it does when told to stop.
        log.info("stopping: rank 0 left during a command (%s)", failure[0])
        return
    if failure:
        raise failure[0]
    dist.destroy_process_group()


def _under_torchrun() -> bool:
    """Whether torchrun's agent started this rank (it names its run in every rank's env)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="meshrl trainer role server")
    parser.add_argument("--role", required=True, choices=sorted(ROLES))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    add_metrics_port_argument(parser)
    args = parser.parse_args(argv)
    use_metrics_port(args)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s trainer[{args.role}:{rank}] %(levelname)s %(name)s: %(message)s",
    )
    return serve_exit_code(lambda: serve(args.role, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
