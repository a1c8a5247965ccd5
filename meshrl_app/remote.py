"""The CLI verbs built on the coordinator service's client (``services/coordinator/client.py``).

    meshrl run --coordinator HOST:PORT [CONFIG.yaml] [key=value ...]   submit, then follow
    meshrl status [RUN] [--coordinator HOST:PORT]
    meshrl stop RUN [--coordinator HOST:PORT]
    meshrl rollout add|remove ADDRESS --run-id RUN [--coordinator HOST:PORT]

The config file is read here, on the client, and sent as text; the paths inside it are
paths on the coordinator's (and role servers') filesystems. Ctrl-C while following asks
the coordinator to stop the run (StopRun) and keeps following until it has; a second
Ctrl-C leaves at once, the run going on without a watcher.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from meshrl.config import ConfigError
from meshrl.config.loader import config_tree
from services.coordinator.client import CoordinatorClient, CoordinatorError
from services.coordinator.types import RunStatus


def follow(client: CoordinatorClient, run_id: str, write: Callable[[str], None]) -> RunStatus:
    """Prints the run's lines until it ends; Ctrl-C asks StopRun once, twice leaves."""
    last: RunStatus | None = None
    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt
        write(f"stopping run {run_id} (Ctrl-C again to leave it running)")
        # not from inside the handler: the main thread is in the middle of the stream
        threading.Thread(target=client.stop_run, args=(run_id,), daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for event in client.watch(run_id):
            last = event.status
            if event.log_line:
                write(event.log_line)
    finally:
        signal.signal(signal.SIGINT, previous)
    if last is None:
        raise CoordinatorError(
            client.address, grpc.StatusCode.UNKNOWN, f"run {run_id}: the stream ended empty"
        )
    return last


def submit(
    address: str,
    config_path: str | None,
    overrides: list[str],
    detach: bool = False,
    write: Callable[[str], None] = print,
) -> int:
    """`meshrl run --coordinator`: exit code 0 succeeded, 1 failed, 3 stopped, 2 bad config
    (refused at submit, or REJECTED once the run found its config or data unusable)."""
    if config_path is None:  # overrides alone, as verl's command lines give them
        text, name = "", "no config file"
    elif config_path == "-":
        text, name = sys.stdin.read(), "the config on standard input"
    elif Path(config_path).is_file():
        text, name = Path(config_path).read_text(), f"config file {config_path}"
    else:
        raise ConfigError(f"config file {config_path} does not exist")
    config_tree(text, name)  # a YAML error names the file here, as a local run's does
    client = CoordinatorClient(address)
    try:
        try:
            status = client.start_run(text, overrides)
        except CoordinatorError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:  # the config: say what, not where
                raise ConfigError(e.details.removeprefix("ConfigError: ")) from None
            raise
        write(f"run {status.run_id} submitted to {address}; run folder {status.run_dir}")
        if detach:
            return 0
        try:
            final = follow(client, status.run_id, write)
        except KeyboardInterrupt:
            write(f"left run {status.run_id} to the coordinator (meshrl status / meshrl stop)")
            return 130
        write(final.describe())
        return final.state.exit_code
    finally:
        client.close()


def format_runs(runs: list[RunStatus]) -> str:
    if not runs:
        return "no runs"
    rows = [("RUN", "STATE", "STEP", "RUN FOLDER", "MESSAGE")]
    rows += [
        (r.run_id, r.state.name, f"{r.step}/{r.total_steps or '?'}", r.run_dir, r.message[:60])
        for r in runs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    ).rstrip()


def status(address: str, run_id: str | None = None, write: Callable[[str], None] = print) -> int:
    client = CoordinatorClient(address)
    try:
        runs = client.list_runs()
        if run_id is not None:
            runs = [r for r in runs if r.run_id == run_id]
            if not runs:
                write(f"no run {run_id!r} on {address}")
                return 1
        write(format_runs(runs))
        return 0
    finally:
        client.close()


def stop(address: str, run_id: str, write: Callable[[str], None] = print) -> int:
    """Asks the run to stop after its current step; says so, or that it had ended."""
    client = CoordinatorClient(address)
    try:
        status = client.stop_run(run_id)
        if status.state.terminal:
            write(f"nothing to stop: {status.describe()}")
        else:  # the status from before the stop takes effect
            write(f"stop requested; it ends after its current step: {status.describe()}")
        return 0
    finally:
        client.close()


def rollout(
    address: str,
    action: str,
    replica: str,
    run_id: str,
    write: Callable[[str], None] = print,
) -> int:
    """`meshrl rollout add|remove`: the rollout server at ``replica`` joins or leaves the
    run's pool at the run's next step boundary (a joiner serves once a weight sync gave it
    the run's weights). Exit 0 asked, 1 refused (ended run, unknown replica, ...)."""
    client = CoordinatorClient(address)
    try:
        change = client.add_rollout_replica if action == "add" else client.remove_rollout_replica
        try:
            status = change(run_id, replica)
        except CoordinatorError as e:
            if e.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                write(f"meshrl rollout {action}: {e.details}")
                return 1
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ConfigError(e.details) from None
            raise
        what = "joins" if action == "add" else "leaves"
        write(
            f"rollout server {replica} {what} run {run_id}'s pool at its next step "
            f"boundary ({status.describe()})"
        )
        return 0
    finally:
        client.close()
