"""A full disk at checkpoint time: the save fails with a CheckpointError naming the folder and
the cause, the half-written temporary folder is removed, and the previous checkpoint stays
complete and valid (it is what a resume uses).

With root, the run folder is a 1 MiB tmpfs (a real ENOSPC from the kernel); elsewhere the
write that fills the disk is simulated."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest

from services.coordinator.recovery.checkpointing import (
    CheckpointError,
    CheckpointManager,
    CoordinatorState,
    verify,
)

pytestmark = pytest.mark.timeout(60)


def _state(step: int) -> CoordinatorState:
    loader = {"epoch": 0, "batch_in_epoch": step, "seed": 1}
    return CoordinatorState.capture(step, loader, {"value": 0.001}, step)


def _roles(nbytes: int):
    """save_roles writing an actor shard of `nbytes`, like the trainer's checkpoint."""

    def save(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        with (tmp / "actor" / "__0_0.distcp").open("wb") as f:
            for _ in range(nbytes // 65536):
                f.write(b"\1" * 65536)

    return save


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs, or a skip where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _check_previous_kept(mgr: CheckpointManager, first: Path, err: CheckpointError) -> None:
    message = str(err)
    assert message.startswith(f"could not write the checkpoint of step 2 in {mgr.root}: ")
    assert "No space left on device" in message
    assert message.endswith(f"the latest checkpoint is still {first}")
    assert mgr.latest_valid() == first
    verify(first)  # complete, checksums intact
    assert [p.name for p in mgr.root.iterdir()] == ["global_step_1"], "no .tmp folder left behind"


def test_full_tmpfs_at_checkpoint_keeps_the_previous_one(tiny_disk):
    mgr = CheckpointManager(tiny_disk / "run")
    first = mgr.save(1, _state(1), "config: 1\n", _roles(256 * 1024))
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, _state(2), "config: 2\n", _roles(2 * 1024 * 1024))
    _check_previous_kept(mgr, first, e.value)
    # the failed attempt freed its space: a save that fits works again
    assert mgr.save(2, _state(2), "config: 2\n", _roles(128 * 1024)).name == "global_step_2"
    assert mgr.latest_valid().name == "global_step_2"


def test_enospc_anywhere_in_the_save_is_reported(tmp_path, monkeypatch):
    """No tmpfs needed: the manifest write (the last file) hits ENOSPC."""
    mgr = CheckpointManager(tmp_path / "run")
    first = mgr.save(1, _state(1), "config: 1\n", _roles(65536))

    def full(folder: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "MANIFEST.json"))

    monkeypatch.setattr("services.coordinator.recovery.checkpointing.write_manifest", full)
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, _state(2), "config: 2\n", _roles(65536))
    _check_previous_kept(mgr, first, e.value)
    assert ".tmp-global_step_2/MANIFEST.json" in str(e.value)


def test_a_failing_trainer_save_is_reported_the_same_way(tmp_path):
    """The actor's own write failing (its RPC error) ends the save the same way."""
    mgr = CheckpointManager(tmp_path / "run")

    def actor_fails(tmp: Path) -> None:
        raise RuntimeError(
            "actor at 127.0.0.1:5 failed during SaveCheckpoint: INTERNAL: "
            "OSError: [Errno 28] No space left on device"
        )

    with pytest.raises(
        CheckpointError, match=r"step 1 in .*: actor at .*Errno 28.*; no earlier checkpoint"
    ):
        mgr.save(1, _state(1), "config: 1\n", actor_fails)
    assert mgr.latest_valid() is None and not list(mgr.root.iterdir())
