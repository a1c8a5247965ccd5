"""One run at a time in a run folder: an OS file lock held for the whole of a run.

Two runs in one folder would resume from each other's checkpoints, append to one
metrics.jsonl and write the same ``global_step_<k>`` folders. The lock is ``flock`` on
``<run folder>/.meshrl-run.lock``: the kernel drops it when its holder's process ends,
however it ends (``kill -9`` included), so it never goes stale as a pid file would. Every
run takes it, whether started by ``meshrl run`` on this machine or by a coordinator
service, so the two refuse each other too.

The holder writes who it is (pid, host, start time) into the file, for the
refusal to name. ``filelock`` is not used: it opens the file with ``O_TRUNC`` on every
attempt, so a refused run would wipe the holder's line before reading it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from meshrl.config import ConfigError

LOCK_FILE = ".meshrl-run.lock"


class RunFolderInUse(ConfigError):
    """Another run holds the run folder (a wrong request here: exit 2, REJECTED)."""


def _holder_line() -> str:
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )


def describe_holder(text: str) -> str:
    """``pid 4242 on host h (since ...)`` from a holder's line; what can be said of a
    holder that has not written it yet (it took the lock a moment ago)."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}"
    except (ValueError, TypeError, KeyError):
        return "a run that is just starting"


class RunFolderLock:
    """``with RunFolderLock(run_dir):`` holds the run folder for the block, or raises
    :class:`RunFolderInUse` naming the folder and its holder. The folder must exist."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunFolderLock:
        # O_CLOEXEC (Python's default): no role server or torchrun rank started from here
        # inherits the lock and keeps it past this process.
        fd = _locked(self.path, self.run_dir)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_holder_line() + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            # the file stays (removing it would race a run taking it); the lock goes
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _locked(path: Path, run_dir: Path) -> int:
    """An open descriptor of ``path`` holding its lock, or RunFolderInUse."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise RunFolderInUse(
            f"trainer.default_local_dir: the run folder {run_dir} is in use by another run "
            f"({describe_holder(holder)}); wait for it to end or stop it, or give this run "
            "another trainer.default_local_dir"
        ) from None
    return fd


def check_run_folder_free(run_dir: Path) -> None:
    """Raises RunFolderInUse when a run holds ``run_dir`` now: a coordinator service
    refuses such a submission at once rather than from the run's thread. Nothing is
    written: the lock is taken and given back."""
    path = Path(run_dir) / LOCK_FILE
    if path.is_file():
        os.close(_locked(path, Path(run_dir)))
