"""Step checkpoints of a run: written atomically, verified by a manifest, resumable.

Layout (see docs/checkpoints.md):

    <run_dir>/checkpoints/global_step_<k>/
        actor/            model + optimizer shards (torch.distributed.checkpoint, one file per rank)
        critic/           the same for the critic, when there is one
        coordinator.json  step, data position, KL controller, RNG, weight version
        config.yaml       the resolved run config
        MANIFEST.json     every file with its size and sha256; written last

A checkpoint is built in a temporary `.tmp-global_step_<k>` folder and renamed into place
only once complete, so a crash never leaves a half-written `global_step_<k>`. Old ones are
removed only after the new one is in place.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PREFIX = "global_step_"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message says which file."""


@dataclass
class CoordinatorState:
    """Everything the coordinator needs to continue exactly where it stopped."""

    step: int
    loader: dict
    kl_ctrl: dict
    weight_version: int
    torch_rng: str  # base64 of torch.get_rng_state()

    @staticmethod
    def capture(step: int, loader: dict, kl_ctrl: dict, weight_version: int) -> CoordinatorState:
        rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        return CoordinatorState(step, loader, kl_ctrl, weight_version, rng)

    def restore_rng(self) -> None:
        raw = base64.b64decode(self.torch_rng)
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify(folder: Path, checksums: bool = True) -> None:
    """Raises CheckpointError naming the first missing or altered file (``checksums=False``:
    by its size alone, without reading it)."""
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}"
        )
    manifest = folder / MANIFEST
    if not manifest.is_file():
        # written last: without it, a save that did not finish (or no checkpoint at all)
        raise CheckpointError(f"{folder}: no {MANIFEST} (an unfinished save, or no checkpoint)")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{manifest}: unreadable ({e})") from None
    for name, meta in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: file {name} is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:  # cut short (a full disk, a copy broken off) or grown
            raise CheckpointError(
                f"{folder}: file {name} is {size} bytes, its manifest says {meta['bytes']}"
            )
        if checksums and _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{folder}: file {name} does not match its checksum")


def step_of(folder: Path) -> int:
    return int(folder.name[len(PREFIX) :])


class CheckpointManager:
    """Saves and finds the step checkpoints of one run folder."""

    def __init__(self, run_dir: Path, max_to_keep: int | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.max_to_keep = max_to_keep

    def complete(self) -> list[Path]:
        """Finished checkpoints (renamed into place), oldest first. Not yet verified."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
        return sorted(found, key=step_of)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; a corrupt one is reported and skipped."""
        for folder in reversed(self.complete()):
            try:
                verify(folder)
                return folder
            except CheckpointError as e:
                log.warning("skipping checkpoint: %s", e)
        return None

    def set_aside_after(self, step: int) -> Path | None:
        """Moves the checkpoints past ``step`` into ``abandoned-<UTC time>/`` and returns that
        folder (None when there were none). A run that starts at ``step`` (0 with
        ``resume_mode=disable``, or an older checkpoint named in it) makes them another
        history: left in place, `auto` would resume from them and pruning by step would
        delete this run's own newer saves first. Moved, not deleted: nothing is lost."""
        later = [f for f in self.complete() if step_of(f) > step]
        if not later:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.root / f"abandoned-{stamp}"
        suffix = 1
        while aside.exists():  # twice in one second: a fresh folder, never a merge
            suffix += 1
            aside = self.root / f"abandoned-{stamp}-{suffix}"
        aside.mkdir()
        for folder in later:
            os.replace(folder, aside / folder.name)
        log.warning(
            "this run starts at step %d: moved the later checkpoints %s of an earlier history to %s",
            step,
            ", ".join(f.name for f in later),
            aside,
        )
        return aside

    def save(
        self,
        step: int,
        state: CoordinatorState,
        config_yaml: str,
        save_roles: Callable[[Path], None],
    ) -> Path:
        """save_roles(tmp_folder) has the actor/critic servers write their shards into it."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{PREFIX}{step}"
        tmp = self.root / f".tmp-{PREFIX}{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            save_roles(tmp)
            (tmp / "coordinator.json").write_text(json.dumps(asdict(state)))
            (tmp / "config.yaml").write_text(config_yaml)
            write_manifest(tmp)
            _fsync_tree(tmp)
            if final.exists():  # a re-run of the same step replaces it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what it took, e.g. on a full disk
            if isinstance(e, Exception):
                raise CheckpointError(self._failure(step, e)) from e
            raise
        self.prune()
        return final

    def _failure(self, step: int, e: Exception) -> str:
        """Names the folder, the cause, and what is kept: nothing was replaced."""
        cause = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e)
        previous = self.complete()
        kept = (
            f"the latest checkpoint is still {previous[-1]}"
            if previous
            else "no earlier checkpoint"
        )
        return f"could not write the checkpoint of step {step} in {self.root}: {cause}; {kept}"

    def prune(self) -> None:
        """Removes the oldest checkpoints beyond max_to_keep (the new one is already complete)."""
        if not self.max_to_keep or self.max_to_keep < 1:  # None (or nonsense): keep them all
            return
        for old in self.complete()[: -self.max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed old checkpoint %s", old.name)

    @staticmethod
    def load_state(folder: Path) -> CoordinatorState:
        data = json.loads((folder / "coordinator.json").read_text())
        return CoordinatorState(**data)


def _fsync_tree(folder: Path) -> None:
    """Flush file contents before the rename makes the checkpoint visible."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
