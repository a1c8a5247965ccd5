"""What a run reads from disk before any role server starts: the tokenizer, the prompt sets
and their loader, the checkpoint `trainer.resume_mode` names.

Read first, so that a missing or malformed data file, an over-long prompt, a model folder
that is not there or a wrong checkpoint path fails in a second or two, naming the key or
the file's row, instead of after every server has started and loaded its model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from meshrl.config import ConfigError, RunConfig
from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.data.loader import PromptLoader
from services.coordinator.checkpointing import CheckpointError, verify
from services.coordinator.preflight import context_length_warning, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class RunData:
    """A run's prompts. ``train_set`` and ``loader`` are None in an evaluation
    (``trainer.val_only``, which reads no training files); ``val_set`` is None without
    ``data.val_files``; ``total_steps`` is 0 in an evaluation."""

    tokenizer: object
    train_set: PromptDataset | None
    val_set: PromptDataset | None
    loader: PromptLoader | None
    total_steps: int


def load_run_data(cfg: RunConfig) -> RunData:
    """Loads the tokenizer (ConfigError naming the key if absent) and the prompt sets
    (DataError naming the file and row), and checks the checkpoint ``resume_mode`` names
    without reading its contents (its checksums are read when the run resumes from it)."""
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    if warning := context_length_warning(cfg):
        log.warning("%s", warning)
    # An evaluation (trainer.val_only) draws no training batch: its training files, if
    # named (as a pasted training command line does), are not read.
    train = not cfg.trainer.val_only
    train_set = make_dataset(cfg, cfg.data.train_files, tokenizer) if train else None
    val_set = make_dataset(cfg, cfg.data.val_files, tokenizer) if cfg.data.val_files else None
    loader = make_loader(cfg, train_set) if train else None
    total_steps = 0
    if loader is not None:
        total_steps = cfg.trainer.total_training_steps or (
            cfg.trainer.total_epochs * loader.steps_per_epoch
        )
    named_resume_folder(cfg, checksums=False)
    return RunData(tokenizer, train_set, val_set, loader, total_steps)


def make_dataset(cfg: RunConfig, files: list[str], tokenizer) -> PromptDataset:
    d = cfg.data
    return PromptDataset(
        files,
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts,
        truncation=d.truncation,
        apply_chat_template=d.apply_chat_template,
        max_samples=d.max_samples,
    )


def make_loader(cfg: RunConfig, train_set: PromptDataset) -> PromptLoader:
    """The batches of prompts each step generates from (`data.gen_batch_size` with dynamic
    sampling, else `data.train_batch_size`); DataError (printed without a traceback) when
    there are too few prompts for one batch, e.g. after overlong ones were filtered out."""
    d = cfg.data
    key = "data.gen_batch_size" if d.gen_batch_size else "data.train_batch_size"
    size = d.gen_batch_size or d.train_batch_size
    try:
        return PromptLoader(train_set, size, shuffle=d.shuffle, seed=d.seed, batch_size_key=key)
    except ValueError as e:
        raise DataError(f"data.train_files: {e}") from None


def named_resume_folder(cfg: RunConfig, checksums: bool = True) -> Path | None:
    """The checkpoint folder ``trainer.resume_mode`` names, verified whole (its files'
    checksums too unless ``checksums=False``); None for ``disable`` and ``auto``. An explicit
    path must be whole: ConfigError naming the key, never a silent fall-back."""
    mode = cfg.trainer.resume_mode
    if mode in ("disable", "auto"):
        return None
    folder = Path(mode).absolute()  # a relative path's error says where it was looked for
    try:
        verify(folder, checksums=checksums)
    except CheckpointError as e:  # the config names it: a wrong request (exit 2)
        what = str(e)
        if (folder / "checkpoints").is_dir() or folder.name == "checkpoints":
            kind = "a run folder" if folder.name != "checkpoints" else "a run's checkpoints"
            what = (
                f"{folder}: {kind}, not one checkpoint; name one of its "
                "checkpoints/global_step_<k> folders, or resume the run in that folder "
                "with trainer.default_local_dir=<it> trainer.resume_mode=auto"
            )
        raise ConfigError(f"trainer.resume_mode: {what}") from None
    return folder
