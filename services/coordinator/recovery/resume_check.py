"""A resume compared with the config its checkpoint was saved under.

A checkpoint's state belongs to its config: a critic's weights to GAE, adapters to their
rank, an optimizer's moments to a model's shapes. Resumed under another config, the run
would go on from state that means nothing for it, silently (verl resumes so). Here:

- **refused**, before any role server starts, naming each key (old → new): the advantage
  estimator, whether the run has a critic, LoRA's rank, alpha and layers, a model of
  other shapes (``config.json``), and a learning rate moved more than 10×;
- **warned about**, one line listing each key old → new: any other setting of the training
  (learning rates within 10×, clip ratios, batch sizes, the data, ...);
- **not compared**: where the run's files go, how its roles are placed and sharded, how
  often it saves or validates, and how long it runs, which change no trained state.

``trainer.resume_allow_config_changes=true`` resumes anyway, every change a warning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshrl.config import ConfigError, RunConfig, config_from_yaml
from services.coordinator.recovery.checkpointing import CheckpointError, verify

ALLOW_KEY = "trainer.resume_allow_config_changes"

STATE_KEYS = (
    "algorithm.adv_estimator",
    *(
        f"{section}.{key}"
        for section in ("actor_rollout_ref.model", "critic.model")
        for key in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")
    ),
)
"""Keys whose change leaves a checkpoint's state meaningless for the run."""

LEARNING_RATES = ("actor_rollout_ref.actor.optim.lr", "critic.optim.lr")
LR_FACTOR = 10.0
"""A learning rate moved by more than this factor (either way) is refused: a typo of an
exponent (1e-3 for 1e-6) more often than a choice."""

MODEL_PATHS = ("actor_rollout_ref.model.path", "critic.model.path")

SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""The fields of a model's config.json that its weights' shapes follow."""

NOT_COMPARED = (
    "launcher.",
    "security.",
    "data.val_files",
    "data.val_batch_size",
    "actor_rollout_ref.rollout.val_kwargs.",
    "actor_rollout_ref.rollout.weight_sync.",
    "actor_rollout_ref.model.tokenizer_path",
    *(
        f"trainer.{key}"
        for key in (
            "project_name",
            "experiment_name",
            "total_epochs",
            "total_training_steps",
            "test_freq",
            "val_before_train",
            "val_only",
            "save_freq",
            "max_ckpt_to_keep",
            "resume_mode",
            "resume_allow_config_changes",
            "default_local_dir",
            "logger",
            "rpc_timeout_s",
            "plot",
            "rollout_data_dir",
            "validation_data_dir",
            "log_val_generations",
        )
    ),
)
"""Prefixes of keys that change no trained state: where files go, placement, how often
the run saves or validates and how long it runs."""

NOT_COMPARED_LEAVES = (
    "world_size",
    "strategy",
    "ppo_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size_per_gpu",
    "use_dynamic_bsz",
    "log_prob_use_dynamic_bsz",
    "ppo_max_token_len_per_gpu",
    "log_prob_max_token_len_per_gpu",
    "forward_max_token_len_per_gpu",
    "enable_gradient_checkpointing",
    "use_remove_padding",
    "param_offload",
    "replicas",
    "max_num_seqs",
    "gpu_memory_utilization",
    "enforce_eager",
    "free_cache_engine",
    "timeout_s",
    "num_workers",
    "micro_batch_size",
)
"""Last parts of keys of how a role computes (sharding, micro-batches, memory), not what."""


@dataclass(frozen=True)
class ConfigChange:
    key: str
    old: object
    new: object
    note: str = ""

    def __str__(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.key} {_show(self.old)} → {_show(self.new)}{note}"


def _show(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _compared(key: str) -> bool:
    return not key.startswith(NOT_COMPARED) and key.rsplit(".", 1)[-1] not in NOT_COMPARED_LEAVES


def model_shape(config_json: Path) -> dict[str, object] | None:
    """The shape fields of a model's config.json; None when it cannot be read."""
    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    return {f: config.get(f) for f in SHAPE_FIELDS} if isinstance(config, dict) else None


def _model_change(key: str, old: str, new: str, old_shape_file: Path) -> tuple[ConfigChange, bool]:
    """(the change, whether it is refused): a model of other shapes is; one of the same
    shapes (a folder moved, another snapshot of the model), or whose shapes cannot be read
    on both sides (the trainer refuses a checkpoint that does not fit it), is not."""
    old_shape = model_shape(old_shape_file)
    new_shape = model_shape(Path(new) / "config.json")
    if old_shape is None or new_shape is None:
        return ConfigChange(key, old, new, "shapes not compared"), False
    differ = [f for f in SHAPE_FIELDS if old_shape[f] != new_shape[f]]
    if differ:
        shapes = ", ".join(f"{f} {_show(old_shape[f])} → {_show(new_shape[f])}" for f in differ)
        return ConfigChange(key, old, new, f"another model: {shapes}"), True
    return ConfigChange(key, old, new, "the same shapes"), False


def resume_changes(
    saved: RunConfig, cfg: RunConfig, checkpoint: Path
) -> tuple[list[ConfigChange], list[ConfigChange]]:
    """(refused, warned): the changes from the config ``checkpoint`` was saved under
    (``saved``) to the run's (``cfg``) that leave its state meaningless, and the others."""
    refused: list[ConfigChange] = []
    warned: list[ConfigChange] = []
    old, new = _flat(saved.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    critic = saved.use_critic and cfg.use_critic
    if saved.use_critic != cfg.use_critic:
        refused.append(ConfigChange("critic.enable", saved.use_critic, cfg.use_critic, "a critic"))
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key) or not _compared(key):
            continue
        if key.startswith("critic.") and not critic:
            continue  # a critic on one side only: said once, above
        if key in MODEL_PATHS:
            # the critic's shapes: its old folder, or the actor's model when it had none
            if key == "critic.model.path":
                old_folder = old.get(key) or old["actor_rollout_ref.model.path"]
                old_file = Path(str(old_folder)) / "config.json"
                new_value = new.get(key) or new["actor_rollout_ref.model.path"]
            else:
                old_file, new_value = checkpoint / "hf" / "config.json", new[key]
            change, refuse = _model_change(key, str(old.get(key)), str(new_value), old_file)
            (refused if refuse else warned).append(change)
        elif key in STATE_KEYS:
            refused.append(ConfigChange(key, old.get(key), new.get(key)))
        elif key in LEARNING_RATES:
            before, after = float(old[key]), float(new[key])  # type: ignore[arg-type]
            factor = max(before, after) / min(before, after) if min(before, after) > 0 else 0
            if factor == 0 or factor > LR_FACTOR:
                note = f"{factor:.0f}x" if factor else "from or to 0"
                refused.append(ConfigChange(key, before, after, note))
            else:
                warned.append(ConfigChange(key, before, after))
        else:
            warned.append(ConfigChange(key, old.get(key), new.get(key)))
    return refused, warned


def saved_config(checkpoint: Path) -> RunConfig | None:
    """The config ``checkpoint`` was saved under; None when it has none to compare (an
    empty or missing config.yaml, or one this version cannot read)."""
    path = checkpoint / "config.yaml"
    try:
        text = path.read_text()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        return config_from_yaml(text)
    except (ConfigError, ValueError):
        return None


def check_resume_config(cfg: RunConfig, checkpoint: Path) -> str | None:
    """Raises ConfigError listing the changes that leave ``checkpoint``'s state meaningless
    for ``cfg`` (unless ``trainer.resume_allow_config_changes``) and saying the ways out;
    returns the warning line for the other changes, or None when nothing changed."""
    saved = saved_config(checkpoint)
    if saved is None:
        return None
    refused, warned = resume_changes(saved, cfg, checkpoint)
    if refused and not cfg.trainer.resume_allow_config_changes:
        raise ConfigError(
            f"trainer.resume_mode={cfg.trainer.resume_mode}: the checkpoint {checkpoint} was "
            f"saved under another config, which its state does not fit: "
            f"{', '.join(map(str, refused))}; train in another trainer.default_local_dir, "
            "start over with trainer.resume_mode=disable, or resume anyway with "
            f"{ALLOW_KEY}=true"
        )
    changes = refused + warned
    if not changes:
        return None
    return f"resuming from {checkpoint} with a changed config: {', '.join(map(str, changes))}"


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
