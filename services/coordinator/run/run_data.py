"""What a run reads from disk before any role server starts: the tokenizer, the prompt sets
and their loader, the checkpoint `trainer.resume_mode` names and the step it resumes at.

Read first, so that a missing or malformed data file, an over-long prompt, a model folder
that is not there or a wrong checkpoint path fails in a second or two, naming the key or
the file's row, instead of after every server has started and loaded its model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from meshrl.config import RunConfig
from meshrl.config.placement import rollout_may_share_trainer_gpus
from meshrl.config.sections import KLCtrlConfig
from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.data.loader import PromptLoader
from services.coordinator.recovery.checkpointing import (
    CheckpointManager,
    step_of,
)
from services.coordinator.recovery.resume_check import check_resume_config, named_resume_folder
from services.coordinator.run.preflight import (
    check_data_sources_here,
    check_ground_truths,
    check_model_weights,
    context_length_warning,
    load_tokenizer,
)
from services.coordinator.types import AlreadyTrained

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


def load_run_data(cfg: RunConfig, run_dir: Path | None = None) -> RunData:
    """Loads the tokenizer (ConfigError naming the key if absent) and the prompt sets
    (DataError naming the file and row), and checks the checkpoint ``resume_mode`` names
    without reading its contents (its checksums are read when the run resumes from it).
    Logs :func:`plan_warnings`; raises :class:`AlreadyTrained` when the checkpoint the run
    resumes from is at its last step. ``run_dir``: the run folder, where ``resume_mode=auto``
    looks (default ``trainer.default_local_dir``; a coordinator service puts a relative
    one under its ``--workdir``)."""
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    check_model_weights(cfg)  # a weights file that does not parse, named, before any server
    if warning := context_length_warning(cfg):
        log.warning("%s", warning)
    # An evaluation (trainer.val_only) draws no training batch: its training files, if
    # named (as a pasted training command line does), are not read.
    train = not cfg.trainer.val_only
    train_set = make_dataset(cfg, cfg.data.train_files, tokenizer) if train else None
    val_set = (
        make_dataset(cfg, cfg.data.val_files, tokenizer, val=True) if cfg.data.val_files else None
    )
    sets = {"data.train_files": train_set, "data.val_files": val_set}
    check_ground_truths(cfg, sets)
    check_data_sources_here(
        cfg,
        {key: [r.data_source for r in ds.records] for key, ds in sets.items() if ds is not None},
    )
    # train: train_set is a data set (make_dataset returns one or raises)
    loader = make_loader(cfg, train_set) if train else None  # type: ignore[arg-type]
    total_steps = 0
    if loader is not None:
        total_steps = cfg.trainer.total_training_steps or (
            cfg.trainer.total_epochs * loader.steps_per_epoch
        )
    named_resume_folder(cfg, checksums=False)
    if not cfg.trainer.val_only:
        run_dir = Path(cfg.trainer.default_local_dir) if run_dir is None else Path(run_dir)
        start_step = resumed_step(cfg, run_dir, total_steps)
        if start_step >= total_steps:
            raise AlreadyTrained(
                f"nothing to train: the run's checkpoint is at step {start_step}, and the "
                f"run has {total_steps} steps (trainer.total_training_steps, or "
                "total_epochs): raise them to train on, or evaluate the checkpoint with "
                "trainer.val_only=true; no role server was started",
                step=start_step,
                total_steps=total_steps,
            )
        if start_step > 0 and (checkpoint := resume_folder(cfg, run_dir)) is not None:
            if warning := check_resume_config(cfg, checkpoint):  # ConfigError: refused
                log.warning("%s", warning)
        for warning in plan_warnings(cfg):
            log.warning("%s", warning)
    return RunData(tokenizer, train_set, val_set, loader, total_steps)


def resumed_step(cfg: RunConfig, run_dir: Path, total_steps: int) -> int:
    """The step the run resumes at: that of the checkpoint ``trainer.resume_mode`` names,
    or with ``auto`` the newest in ``run_dir``; 0 without one. Read from the folders'
    names and coordinator.json. The checksums, which take seconds a GB, are read here only
    when the answer is "at or past the last step" (the run then ends before any server
    starts), so that a corrupt last checkpoint is skipped, as a resume skips it, rather
    than ending the run."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return 0
    checkpoints = CheckpointManager(run_dir)
    if mode == "auto":
        complete = checkpoints.complete()
        if not complete or step_of(complete[-1]) < total_steps:
            return step_of(complete[-1]) if complete else 0
        folder = checkpoints.latest_valid()  # checksums; reports a corrupt one and skips it
        return 0 if folder is None else checkpoints.load_state(folder).step
    named = named_resume_folder(cfg, checksums=False)
    assert named is not None  # a path: disable and auto are answered above
    step = checkpoints.load_state(named).step
    if step >= total_steps:
        named_resume_folder(cfg)  # the checksums too: ConfigError naming a corrupt file
    return step


def resume_folder(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The checkpoint the run resumes from, as :func:`resumed_step` reads it: the one
    ``trainer.resume_mode`` names, or with ``auto`` the newest complete one of ``run_dir``
    (should it not verify, the resume takes the one before, which a run's history shares
    its config with but for resumes); None without one."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        complete = CheckpointManager(run_dir).complete()
        return complete[-1] if complete else None
    return Path(mode).absolute()


def plan_warnings(cfg: RunConfig) -> list[str]:
    """What a user would not want to learn only at the end of a run: that it keeps nothing
    (no checkpoint), never validates though asked to, or overlaps little though asked to."""
    trainer = cfg.trainer
    out = []
    if trainer.test_freq > 0 and not cfg.data.val_files:
        out.append(
            f"trainer.test_freq={trainer.test_freq}, but data.val_files is empty: this run "
            "validates nothing"
        )
    if trainer.save_freq <= 0:
        out.append(
            f"trainer.save_freq={trainer.save_freq}: this run saves no checkpoint of its steps "
            "(only a stop saves one, to resume from), so its trained model is not kept "
            "(verl's default too); set trainer.save_freq=N for one every N steps and at the "
            "last step"
        )
    if warning := unused_kl_ctrl_warning(cfg):
        out.append(warning)
    reward_model = cfg.reward.reward_model
    if reward_model.path and not reward_model.enable:
        out.append(
            f"reward.reward_model.path={reward_model.path}, but reward.reward_model.enable is "
            "false: the reward model is not loaded and every row is scored by its rule scorer "
            "(or reward.custom_function); set reward.reward_model.enable=true to score with it"
        )
    overlapped = [
        key
        for key, on in (
            ("trainer.one_step_off_policy", trainer.one_step_off_policy),
            ("trainer.async_training.enable", trainer.async_training.enable),
        )
        if on
    ]
    if overlapped and rollout_may_share_trainer_gpus(cfg):
        out.append(
            f"{overlapped[0]}=true with rollout on a GPU of the trainer roles: they "
            "take turns on it, so little overlaps, and rollout keeps its KV cache while they "
            "run (rollout.free_cache_engine does not apply); it pays with rollout on GPUs of "
            "its own (launcher.role_gpus, or a Ray pool of its own)"
        )
    return out


def unused_kl_ctrl_warning(cfg: RunConfig) -> str | None:
    """A line when ``algorithm.kl_ctrl`` is moved from its defaults but applies to nothing:
    its β weighs the KL penalty in the reward only (``use_kl_in_reward``). A user who set
    it for the KL loss (``actor.use_kl_loss``, as in verl's GRPO recipes) would otherwise
    train with ``actor.kl_loss_coef`` and never learn that the value they chose is unused."""
    algorithm = cfg.algorithm
    ctrl, default = algorithm.kl_ctrl, KLCtrlConfig()
    if algorithm.use_kl_in_reward or ctrl == default:
        return None
    moved = ", ".join(
        f"algorithm.kl_ctrl.{key}={getattr(ctrl, key)}"
        for key in type(ctrl).model_fields
        if getattr(ctrl, key) != getattr(default, key)
    )
    actor = cfg.actor_rollout_ref.actor
    loss = (
        f"the KL loss (actor.use_kl_loss=true) weighs its term by "
        f"actor.kl_loss_coef={actor.kl_loss_coef}"
        if actor.use_kl_loss
        else "this run has no KL term at all (actor.use_kl_loss=false)"
    )
    return (
        f"{moved} has no effect: kl_ctrl sets the KL penalty in the reward, which "
        f"algorithm.use_kl_in_reward=false turns off; {loss}"
    )


def make_dataset(cfg: RunConfig, files: list[str], tokenizer, val: bool = False) -> PromptDataset:
    d = cfg.data
    key = "data.val_max_samples" if val else "data.max_samples"
    return PromptDataset(
        files,
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts,
        truncation=d.truncation,
        apply_chat_template=d.apply_chat_template,
        max_samples=d.val_max_samples if val else d.max_samples,
        max_samples_key=key,
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
