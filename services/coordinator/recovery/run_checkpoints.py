"""A run's checkpoints: the one it resumes from, the ones it saves, and the one it goes back
to after a crash lost training state. The files themselves are
:class:`~services.coordinator.recovery.checkpointing.CheckpointManager`'s."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from meshrl.config import ConfigError, RunConfig, config_to_yaml
from meshrl.model_files import copy_model_files
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_ahead import PromptsDrawnAhead
from services.coordinator.recovery.checkpointing import (
    CheckpointError,
    CheckpointManager,
    CoordinatorState,
)
from services.coordinator.recovery.resume_check import named_resume_folder
from services.coordinator.recovery.run_progress import RunProgress
from services.coordinator.roles.role_servers import RoleServers

log = logging.getLogger(__name__)


def resume_folder(cfg: RunConfig, manager: CheckpointManager) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` names: the newest valid one of the run folder
    (``auto``), a folder given as a path, or None (``disable``, or nothing saved yet)."""
    if cfg.trainer.resume_mode == "auto":
        return manager.latest_valid()
    return named_resume_folder(cfg)


class RunCheckpoints:
    """Saves and loads the state of every trainer and of the coordinator as one checkpoint."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        servers: RoleServers,
        progress: RunProgress,
        pool: ThreadPoolExecutor,
        ahead: PromptsDrawnAhead | None = None,
    ):
        self.cfg = cfg
        self.servers = servers
        self.progress = progress
        self.pool = pool
        self.ahead = ahead
        self.manager = CheckpointManager(run_dir, cfg.trainer.max_ckpt_to_keep)
        self.resumed_from: Path | None = None  # the checkpoint this run started from, if any
        self.last_saved: Path | None = None  # the checkpoint this run wrote last, if any

    def resume(self) -> None:
        """Loads the checkpoint ``trainer.resume_mode`` names, if any; a checkpoint of another
        model is the request's fault (ConfigError: exit 2)."""
        folder = resume_folder(self.cfg, self.manager)
        if folder is not None:
            try:
                self.load(folder)
            except RoleCallError as e:
                if e.code_name != "INVALID_ARGUMENT":
                    raise
                # A checkpoint of another model (width, layers, LoRA): the way out is another
                # folder or not resuming.
                mode = self.cfg.trainer.resume_mode
                elsewhere = (
                    "use another trainer.default_local_dir"
                    if mode == "auto"
                    else "name another checkpoint in trainer.resume_mode"
                )
                raise ConfigError(
                    f"trainer.resume_mode={mode}: {e}. To train this model afresh, {elsewhere} "
                    "or set trainer.resume_mode=disable"
                ) from None
            self.resumed_from = folder
        if not self.cfg.trainer.val_only:  # an evaluation writes no history: nothing moves
            self.manager.set_aside_after(self.progress.step)

    def load(self, folder: Path) -> None:
        """Every trainer and the coordinator's state back to ``folder``'s step."""
        saved = self.manager.load_state(folder)
        roles = self.servers.roles
        for name, client in (("actor", roles.actor), ("critic", roles.critic)):
            if client is not None:
                if not (folder / name).is_dir():
                    raise CheckpointError(f"{folder}: no {name}/ folder to resume the {name} from")
                client.load_checkpoint(str(folder / name))
        if self.progress.loader is not None:
            self.progress.loader.load_state_dict(saved.loader)
        self.progress.kl_ctrl.load_state_dict(saved.kl_ctrl)
        saved.restore_rng()
        self.progress.step = saved.step
        log.info("resumed from %s (step %d)", folder, saved.step)

    def save(self) -> Path:
        """A checkpoint of the step just completed (``progress.step``)."""
        progress = self.progress
        assert progress.loader is not None  # a training run
        loader = progress.loader.state_dict()
        if self.ahead is not None:  # not past the prompts drawn ahead: their step is not done
            loader = self.ahead.loader_state(loader, progress.step)
        step = progress.step
        coordinator = CoordinatorState.capture(step, loader, progress.kl_ctrl.state_dict(), step)
        saved = self.manager.save(step, coordinator, config_to_yaml(self.cfg), self._save_roles)
        self.last_saved = saved
        return saved

    def _save_roles(self, tmp: Path) -> None:
        model = self.cfg.actor_rollout_ref.model
        if Path(model.path).is_dir():  # config + tokenizer make the checkpoint exportable alone
            tokenizer = Path(model.tokenizer_path) if model.tokenizer_path else None
            copy_model_files(Path(model.path), tokenizer, tmp / "hf")
        roles = self.servers.roles
        jobs = [
            self.pool.submit(c.save_checkpoint, str(tmp / name))
            for name, c in (("actor", roles.actor), ("critic", roles.critic))
            if c is not None
        ]
        wait(jobs)  # every save has ended before the folder is removed on a failure
        for f in jobs:
            f.result()

    def due(self, last: bool) -> bool:
        """Whether the step just completed is saved (``trainer.save_freq``; the last always)."""
        freq = self.cfg.trainer.save_freq
        return freq > 0 and (self.progress.step % freq == 0 or last)

    def rewind_folder(self) -> Path | None:
        """The checkpoint this run saved last, else the one it resumed from (which
        `resume_mode=<path>` may take from another run's folder). Not simply the folder's
        newest: after resuming from an older step, a newer one left there by the abandoned
        history is not this run's past."""
        for folder in (self.last_saved, self.resumed_from):
            if folder is not None and folder.is_dir():  # not pruned since
                return folder
        return None
