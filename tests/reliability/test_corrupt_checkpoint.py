"""A corrupt or partial checkpoint is detected by its manifest and the previous one is used;
named explicitly (trainer.resume_mode=<path>), it is refused with the file it fails on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.coordinator.recovery.checkpointing import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    CoordinatorState,
    verify,
)

pytestmark = pytest.mark.timeout(60)


def _save(mgr: CheckpointManager, step: int) -> Path:
    def roles(tmp: Path) -> None:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)

    state = CoordinatorState.capture(
        step, {"epoch": 0, "batch_in_epoch": step, "seed": 1}, {}, step
    )
    return mgr.save(step, state, "config: {}\n", roles)


def test_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    first, second = _save(mgr, 1), _save(mgr, 2)
    shard = second / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, other content: only the checksum can tell
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert mgr.latest_valid() == first
    assert (
        f"skipping checkpoint: {second}: file actor/__0_0.distcp does not match its checksum"
        in caplog.text
    )
    with pytest.raises(CheckpointError, match="actor/__0_0.distcp does not match its checksum"):
        verify(second)  # what resume_mode=<that path> runs: no silent fallback


def test_partial_and_truncated_checkpoints_are_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path)
    first = _save(mgr, 1)
    partial = _save(mgr, 2)
    (partial / MANIFEST).unlink()  # as if the copy of a folder stopped half-way
    truncated = _save(mgr, 3)
    (truncated / "actor" / "__0_0.distcp").write_bytes(b"")
    assert mgr.latest_valid() == first
    with pytest.raises(
        CheckpointError,
        match=r"global_step_2: no MANIFEST.json \(an unfinished save, or no checkpoint\)",
    ):
        verify(partial)
    # a file cut short says so, with or without its checksum read (before: "does not match
    # its checksum" though none was read)
    for checksums in (True, False):
        with pytest.raises(
            CheckpointError,
            match="global_step_3: file actor/__0_0.distcp is 0 bytes, its manifest says 16384",
        ):
            verify(truncated, checksums=checksums)
    (truncated / "actor" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="global_step_3: file actor/__0_0.distcp is missing"):
        verify(truncated)
