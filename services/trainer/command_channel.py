"""How rank 0 hands each command to the other trainer ranks, without pickle.

A command is a small int64 header ``(method id, payload length)`` broadcast from rank 0,
then the payload (a serialized request proto) as uint8. Every rank runs the same handler on
it; afterwards all ranks exchange a success flag, so a failure on any rank fails the call.

The channel has its own gloo group: waiting ranks sit in a broadcast for as long as the
server is idle, and that must neither time out nor interleave with FSDP's collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHUTDOWN = -1
# Idle ranks wait in a broadcast between commands; the server may be idle for days.
_IDLE_TIMEOUT = timedelta(days=365)


class CommandChannel:
    """Created collectively by every rank, right after the default group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)

    def send(self, method_id: int, payload: bytes) -> None:
        """Rank 0: hands a command to the other ranks."""
        if self.world_size == 1:
            return
        header = torch.tensor([method_id, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self._group)

    def receive(self) -> tuple[int, bytes]:
        """Other ranks: blocks until rank 0 sends the next command."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        method_id, length = int(header[0]), int(header[1])
        if length == 0:
            return method_id, b""
        data = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._group)
        return method_id, data.numpy().tobytes()

    def failed_ranks(self, ok: bool) -> list[int]:
        """Every rank reports whether its handler succeeded; returns the ranks that failed."""
        if self.world_size == 1:
            return [] if ok else [0]
        flags = torch.zeros(self.world_size, dtype=torch.int64)
        flags[self.rank] = 0 if ok else 1
        dist.all_reduce(flags, group=self._group)
        return [r for r in range(self.world_size) if flags[r]]

    def shutdown(self) -> None:
        """Rank 0: releases the waiting ranks (they return from ``serve_commands``)."""
        try:
            self.send(SHUTDOWN, b"")
        except Exception as e:  # noqa: BLE001 - the other ranks may already be gone
            log.warning("could not send shutdown to the other ranks: %s", e)


def serve_commands(
    channel: CommandChannel,
    handle: Callable[[int, bytes], None],
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """The loop of ranks other than 0: run each command until SHUTDOWN.

    A failing handler is logged here and reported to rank 0 through ``failed_ranks``; the
    rank stays in the loop, ready for the next command. Once ``stopping()`` (this rank was
    told to stop), a failure is re-raised instead: rank 0, stopping too, leaves without
    finishing the command in flight, and its collectives then fail here; that is no
    command's error to log with a traceback nor to report to a rank that is gone.
    """
    while True:
        method_id, payload = channel.receive()
        if method_id == SHUTDOWN:
            return
        ok = True
        try:
            handle(method_id, payload)
        except Exception:  # noqa: BLE001 - rank 0 turns it into the RPC's error
            if stopping():
                raise
            log.exception("rank %d: command %d failed", channel.rank, method_id)
            ok = False
        channel.failed_ranks(ok)
