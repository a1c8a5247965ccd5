"""Ctrl-C and SIGTERM of `meshrl run` on this machine, from the moment the command starts.

Before the run trains (its config read, its modules imported, its data read, its role
servers starting or loading their models), the first signal stops the start at once:
:class:`~services.coordinator.types.StoppedBeforeStart`, which the launcher's clean-up lets
through and the CLI answers with one line and exit 3, the code of any stop. Once it trains,
the first signal finishes the current step and checkpoints (exit 3). A second signal
interrupts (KeyboardInterrupt: exit 130). Before, a signal during the start printed a
KeyboardInterrupt traceback and exited 130, or (SIGTERM) killed the command without a word.

Light to import: the CLI installs it before it imports torch and the coordinator.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from services.coordinator.types import StoppedBeforeStart

if TYPE_CHECKING:
    from services.coordinator.run.run import PPORun

log = logging.getLogger(__name__)


class GracefulStop:
    """First SIGINT/SIGTERM: before the run trains (its start-up), stops it there
    (:class:`StoppedBeforeStart`); once it trains, asks the run to stop after its step.
    The second interrupts (KeyboardInterrupt: exit 130)."""

    installed = False
    """Whether a run of this process handles its signals (a KeyboardInterrupt before that
    was a first Ctrl-C: nothing had started)."""

    def __init__(self) -> None:
        self.run: PPORun | None = None
        self.training = False
        self.signals = 0
        self.previous: dict[int, Any] = {}  # what signal.signal gave back

    def __enter__(self) -> GracefulStop:
        GracefulStop.installed = True
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def trains(self, run: PPORun) -> None:
        """The run has set up: a first signal now finishes the step and checkpoints."""
        self.run, self.training = run, True

    def _handle(self, signum, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            raise KeyboardInterrupt(f"signal {signum}")
        if not self.training or self.run is None:
            log.warning("signal %d: stopping the start; every role server stops", signum)
            raise StoppedBeforeStart(signum)
        log.warning(
            "signal %d: finishing the current step, then checkpoint and stop (again to abandon it)",
            signum,
        )
        self.run.stop()

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
