"""The run-folder lock: one run at a time in a folder, freed when its holder ends, however.
The refusal by a second `meshrl run` process is in tests/launcher/test_run_folder_lock.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from services.coordinator.run.run_folder_lock import (
    LOCK_FILE,
    RunFolderInUse,
    RunFolderLock,
    check_run_folder_free,
)
from services.coordinator.run.run_manager import RunConflict, RunManager


def test_a_held_folder_is_refused_naming_the_holder_and_freed_after(tmp_path):
    with RunFolderLock(tmp_path):
        with pytest.raises(RunFolderInUse) as refused:
            with RunFolderLock(tmp_path):
                pass
        assert str(refused.value).startswith(
            f"trainer.default_local_dir: the run folder {tmp_path} is in use by another run "
            f"(pid {os.getpid()} on host {socket.gethostname()}, since "
        )
        assert str(refused.value).endswith(
            "wait for it to end or stop it, or give this run another trainer.default_local_dir"
        )
        with pytest.raises(RunFolderInUse):
            check_run_folder_free(tmp_path)
    check_run_folder_free(tmp_path)  # given back at the block's end
    with RunFolderLock(tmp_path):
        pass
    assert (tmp_path / LOCK_FILE).read_text() == ""  # no holder left named


def test_the_probe_writes_nothing_and_a_folder_never_locked_is_free(tmp_path):
    check_run_folder_free(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()
    with RunFolderLock(tmp_path):
        line = (tmp_path / LOCK_FILE).read_text()
        with pytest.raises(RunFolderInUse):
            check_run_folder_free(tmp_path)
        assert (tmp_path / LOCK_FILE).read_text() == line  # the holder's line kept


def test_the_lock_of_a_process_killed_by_sigkill_is_free_at_once(tmp_path):
    """No stale pid file: the kernel drops a flock with its last descriptor."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys, time
                from services.coordinator.run.run_folder_lock import RunFolderLock
                with RunFolderLock({str(tmp_path)!r}):
                    print("held", flush=True)
                    time.sleep(60)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(RunFolderInUse, match=f"pid {holder.pid} on host"):
            check_run_folder_free(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunFolderLock(tmp_path):  # taken at once
        pass


def test_a_coordinator_service_refuses_a_folder_another_process_holds(tmp_path):
    """A `meshrl run` on this machine holds the folder: the submission is refused at once
    (FAILED_PRECONDITION, as for a folder a run of the service itself uses)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manager = RunManager(tmp_path, lambda cfg, run_dir: None, lambda *a: None)
    run_yaml = (
        f"trainer: {{default_local_dir: {run_dir}}}\n"
        "data: {train_files: [never_read.parquet]}\n"
        "actor_rollout_ref: {model: {path: never_read}}\n"
    )
    with RunFolderLock(run_dir):
        with pytest.raises(RunConflict, match=f"the run folder {run_dir} is in use by another"):
            manager.start(run_yaml, [])
    assert manager.list() == []
