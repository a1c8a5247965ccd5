"""What the coordinator service tells about a run: its status and the events of its stream.

Plain dataclasses, shared by the service (run_manager.py, server.py) and its CLI client
(client.py, and the CLI verbs of meshrl_app/remote.py); light to import, so `meshrl status`
does not load torch.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field, replace


class RunState(enum.Enum):
    """Life of a run: STARTING -> RUNNING -> one of the four terminal states."""

    STARTING = 1  # role servers starting or initializing
    RUNNING = 2  # PPO steps under way
    SUCCEEDED = 3  # all steps done
    FAILED = 4  # an error ended it (RunStatus.message says which)
    STOPPED = 5  # StopRun (or the coordinator shutting down) ended it early
    REJECTED = 6  # its config or data proved unusable once it started (message says which)

    @property
    def terminal(self) -> bool:
        return self in _EXIT_CODES

    @property
    def exit_code(self) -> int:
        """What `meshrl run` exits with when a run ends so, locally or through a coordinator:
        0 succeeded, 1 failed, 2 the request was wrong, 3 stopped."""
        return _EXIT_CODES.get(self, 1)


class AlreadyTrained(Exception):  # noqa: N818 - an outcome, not a failure
    """The run's checkpoint is at or past its last step: there is nothing to train, and no
    role server is started (the run SUCCEEDED at that step). The message says where it
    stands and how to go on."""

    def __init__(self, message: str, step: int = 0, total_steps: int = 0):
        super().__init__(message)
        self.step = step
        """The step of the checkpoint: where the run ends."""
        self.total_steps = total_steps


_EXIT_CODES = {
    RunState.SUCCEEDED: 0,
    RunState.FAILED: 1,
    RunState.REJECTED: 2,
    RunState.STOPPED: 3,
}

# A second Ctrl-C / SIGTERM abandoned the step (KeyboardInterrupt): 128 + SIGINT, as a shell
# reports a process that SIGINT ended.
INTERRUPTED_EXIT_CODE = 130


class StoppedBeforeStart(BaseException):  # noqa: N818 - a stop, as KeyboardInterrupt is
    """A stop (Ctrl-C, SIGTERM) while the run started: its data read, its servers starting
    or loading their models. Nothing trained, so nothing is saved; the launcher stops the
    servers on the way out and ``meshrl run`` exits 3, as for any stop. A BaseException, as
    KeyboardInterrupt: no handler of ordinary errors takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"stopped by {name} while the run started (before its first step)"


def ended_exit_code(error: BaseException | None, finished: bool) -> int:
    """How a run ended, as the exit code `meshrl run` exits with and its metrics sinks record
    (a wandb run is marked failed for any code but 0). ``error``: what ended it, None when
    it returned; ``finished``: whether it then had done every step.

    0 every step done; 3 stopped early (StopRun, a first Ctrl-C / SIGTERM: not a success,
    though it resumes from its checkpoint); 2 its config or data proved unusable once
    started; 130 interrupted (a second Ctrl-C); 1 any other error."""
    if error is None:
        return (RunState.SUCCEEDED if finished else RunState.STOPPED).exit_code
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_EXIT_CODE
    if isinstance(error, StoppedBeforeStart):
        return RunState.STOPPED.exit_code
    # Imported here: `meshrl status` imports this module, and must stay light.
    from meshrl.config import ConfigError
    from meshrl.data.errors import DataError

    if isinstance(error, ConfigError | DataError):  # as ManagedRun marks the run REJECTED
        return RunState.REJECTED.exit_code
    return RunState.FAILED.exit_code


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    state: RunState
    step: int = 0  # last finished PPO step
    total_steps: int = 0  # 0 until the data is loaded
    message: str = ""  # error text when FAILED
    run_dir: str = ""

    def evolve(self, **changes) -> RunStatus:
        return replace(self, **changes)

    def describe(self) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        text = f"run {self.run_id} {self.state.name} step {self.step}{total}"
        return f"{text}: {self.message}" if self.message else text


@dataclass(frozen=True)
class RunEvent:
    """One item of a WatchRun stream: the status after it, and what happened."""

    status: RunStatus
    metrics: dict[str, float] = field(default_factory=dict)  # a step's metrics, else empty
    log_line: str = ""
