"""`meshrl export CHECKPOINT --role actor|critic --to DIR`: a step checkpoint to a Hugging
Face folder (config, safetensors, tokenizer, generation config).

The trainer's shards are read straight from the torch.distributed.checkpoint files a
group of tensors at a time and written as safetensors shards, so no process ever holds
the whole model: the export works the same for a model saved by 1 rank or by 64.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from meshrl.model_files import copy_side_files
from services.coordinator.recovery.checkpointing import (
    MANIFEST,
    PREFIX,
    CheckpointError,
    step_of,
    verify,
)
from services.trainer.checkpoint import META_FILE
from services.trainer.lora import ADAPTER, BASE, hf_name, merged_weight

SHARD_BYTES = 2 * 1024**3
PARTIAL = ".partial-export"
"""An export being written inside an existing, empty output folder."""
ROLES = ("actor", "critic")


class ExportError(ValueError):
    pass


def read_shards(state: dict, reader) -> None:
    """``dcp.load`` in this one process. torch warns "torch.distributed is disabled ..."
    on every call, even when told ``no_dist=True``: the warning says nothing to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)


def _rename(role: str, key: str) -> str | None:
    """DCP key -> Hugging Face name. actor: `model.<hf name>`; critic: decoder + value head
    become a `*ForTokenClassification` with one label (`score` = value head)."""
    if not key.startswith("model."):
        return None  # optimizer state
    # A LoRA layer's base weight takes the layer's own name; its adapter factors are
    # merged into it (_merge_adapters) and have none.
    name = hf_name(key[len("model.") :])
    if name is None:
        return None
    if role == "critic":
        if name.startswith("value_head."):
            return "score." + name[len("value_head.") :]
        return name  # "model.layers..." is already the decoder's name inside the classifier
    return name


def _groups(items: list[tuple[str, TensorStorageMetadata]], limit: int, dtype: torch.dtype | None):
    """Tensors in groups of at most `limit` bytes as written (in `dtype`, when it is set)."""
    group: list[tuple[str, TensorStorageMetadata]] = []
    size = 0
    for key, meta in items:
        saved = dtype if dtype is not None and meta.properties.dtype.is_floating_point else None
        element = torch.empty(0, dtype=saved or meta.properties.dtype).element_size()
        nbytes = meta.size.numel() * element
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append((key, meta))
        size += nbytes
    if group:
        yield group


# --- what is exported, from where -----------------------------------------------------


def check_checkpoint(checkpoint: Path, role: str) -> None:
    """A complete step checkpoint holding `role`; otherwise an error that says what the path
    is (a run folder, a role's sub-folder, nothing) before the manifest's verdict."""
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint}: no such folder")
    if not (checkpoint / MANIFEST).is_file() and (hint := _checkpoint_hint(checkpoint)):
        raise ExportError(f"{checkpoint} is not a step checkpoint: {hint}")
    try:
        verify(checkpoint)
    except CheckpointError as e:  # the path the user named: a wrong request (exit 2)
        raise ExportError(str(e)) from None
    if not (checkpoint / role).is_dir():
        raise ExportError(f"{checkpoint} holds no {role}/ folder (the run had no {role})")


def _checkpoint_hint(path: Path) -> str | None:
    # verl's model merger takes `global_step_<k>/actor`, so engineers coming from it pass that.
    if path.name in ROLES and (path.parent / MANIFEST).is_file():
        return f"pass its step folder, {path.parent}, with --role {path.name}"
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
    if steps:
        return f"pass one of its {PREFIX}<k> folders, e.g. the latest, {max(steps, key=step_of)}"
    return None


def saved_run_config(checkpoint: Path) -> dict:
    path = checkpoint / "config.yaml"
    return (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}


def configured_path(run_cfg: dict, *keys: str) -> str:
    node: Any = run_cfg
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node or ""


def _side_folder(checkpoint: Path, run_cfg: dict) -> Path:
    """Config, tokenizer and generation config: the checkpoint's hf/, or for checkpoints
    older than hf/ the run's model folder (which must still exist)."""
    if (checkpoint / "hf" / "config.json").is_file():
        return checkpoint / "hf"
    model = configured_path(run_cfg, "actor_rollout_ref", "model", "path")
    if not (Path(model) / "config.json").is_file():
        raise ExportError(
            f"{checkpoint} holds no hf/config.json, and the run's model folder "
            f"(actor_rollout_ref.model.path = {model!r}) has none either: without the "
            "model's config.json the weights cannot be exported"
        )
    return Path(model)


def _critic_config_folder(checkpoint: Path, run_cfg: dict, side: Path) -> Path:
    """A critic started from a model of its own (critic.model.path) has that model's shapes,
    not the actor's; the exported config must come from there."""
    own = configured_path(run_cfg, "critic", "model", "path")
    if not own or own == configured_path(run_cfg, "actor_rollout_ref", "model", "path"):
        return side
    if not (Path(own) / "config.json").is_file():
        raise ExportError(
            f"the critic of {checkpoint} started from its own model (critic.model.path = "
            f"{own!r}), whose config.json is needed for its shapes and is not there"
        )
    return Path(own)


def _hf_config(role: str, config_folder: Path):
    config = AutoConfig.from_pretrained(config_folder, local_files_only=True)
    if role == "critic":
        base = config.architectures[0].replace("ForCausalLM", "")
        config.architectures = [f"{base}ForTokenClassification"]
        config.num_labels = 1
    return config


def _saved_dtype(config) -> torch.dtype | None:
    """The dtype config.json declares (`dtype`, formerly `torch_dtype`): the trainer's float32
    masters are written in it, so a bfloat16 model comes back as bfloat16 (the size of the
    folder it started from, and what `from_pretrained` would load it as anyway)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _tied_copies(config) -> tuple[str, ...]:
    """Names that are the same tensor as another one under tied embeddings: left out, as
    `save_pretrained` leaves them out (the loader ties them again); otherwise the folder
    would carry the embedding twice (272 MB more for Qwen2.5-0.5B)."""
    return ("lm_head.weight",) if getattr(config, "tie_word_embeddings", False) else ()


def _check_shapes(role: str, config, shapes: dict[str, torch.Size]) -> None:
    """The tensors must be the ones the config's architecture has, with its shapes: a
    mismatch would load as randomly initialised weights, or not at all."""
    auto = AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: no memory, no init
        expected = {k: v.shape for k, v in auto.from_config(config).state_dict().items()}
    problems = [
        f"{k}: {tuple(s)} in the checkpoint, {tuple(expected[k])} in config.json"
        for k, s in shapes.items()
        if k in expected and expected[k] != s
    ]
    arch = (config.architectures or [config.model_type])[0]
    problems += [f"{k}: not a weight of {arch}" for k in shapes if k not in expected]
    problems += [
        f"{k}: missing from the checkpoint"
        for k in expected
        if k not in shapes and k not in _tied_copies(config)
    ]
    if problems:
        raise ExportError(
            f"the {role}'s weights do not fit its config.json ({len(problems)} problems): "
            + "; ".join(problems[:5])
        )


# --- the output folder --------------------------------------------------------------


def check_output(out: Path) -> None:
    # Never mix with what is there: stale shards and their index beside new ones are loaded
    # by vLLM (it follows the index), and an actor and a critic would overwrite each other.
    if out.exists() and (
        not out.is_dir() or any(p.name != PARTIAL for p in out.iterdir())  # a killed export's
    ):
        raise ExportError(
            f"{out} already exists and is not empty: export into a new or empty folder"
        )


def staging_folder(out: Path) -> Path:
    """Where the export is written before it takes the output's name: beside the output, or
    inside it when it exists (empty: a mount point such as `docker run -v host:/out` cannot
    be removed or replaced, and its parent may not be writable)."""
    if out.is_dir():
        return out / PARTIAL
    return out.parent / f".tmp-export-{out.name}"


def publish(tmp: Path, out: Path) -> None:
    """The finished export takes the output's name; config.json comes last, so an interrupted
    export never leaves a folder that looks complete."""
    if tmp.parent != out:
        os.replace(tmp, out)
        return
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda n: n == "config.json"):
        os.replace(tmp / name, out / name)
    tmp.rmdir()


def _lora_scaling(shards_dir: Path) -> float | None:
    """The adapters' lora_alpha / r, from the role's meta.json (None: no adapters)."""
    meta_file = shards_dir / META_FILE
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    lora = meta.get("lora")
    return None if lora is None else float(lora["scaling"])


def _merge_adapters(
    state: dict[str, torch.Tensor], reader, metadata: dict, scaling: float | None
) -> None:
    """Merges each LoRA layer's factors into its base weight in ``state`` (DCP keys without
    the ``model.`` prefix), reading the factors, which are small, as they are needed."""
    for key, base in state.items():
        if BASE not in key or not key.endswith(".weight"):
            continue
        layer = key[: key.index(BASE)]
        factors = {f"{layer}.lora_{ab}.{ADAPTER}.weight": None for ab in ("A", "B")}
        missing = [k for k in factors if f"model.{k}" not in metadata]
        if missing or scaling is None:
            raise ExportError(
                f"{key} is a LoRA layer's base weight, but the checkpoint lacks "
                + (f"{missing[0]}" if missing else "the adapters' settings (meta.json 'lora')")
            )
        loaded = {
            k: torch.empty(
                metadata[f"model.{k}"].size, dtype=metadata[f"model.{k}"].properties.dtype
            )
            for k in factors
        }
        read_shards({"model": loaded}, reader)
        a, b = loaded.values()
        state[key] = merged_weight(base, a, b, scaling)


def _write_weights(
    shards_dir: Path,
    role: str,
    dest: Path,
    config,
    shard_bytes: int,
) -> None:
    reader = dcp.FileSystemReader(str(shards_dir))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = [
        (k, m)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
        and _rename(role, k) not in (None, *_tied_copies(config))
    ]
    # tensors holds only the keys that _rename keeps (not None)
    _check_shapes(role, config, {cast(str, _rename(role, k)): m.size for k, m in tensors})
    dtype = _saved_dtype(config)
    scaling = _lora_scaling(shards_dir)
    index: dict[str, str] = {}
    total = 0
    groups = list(_groups(tensors, shard_bytes, dtype))
    for i, group in enumerate(groups):
        state = {
            "model": {
                k[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in group
            }
        }
        read_shards(state, reader)
        _merge_adapters(state["model"], reader, metadata, scaling)
        name = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        shard = {
            cast(str, _rename(role, "model." + k)): _as_saved(v, dtype)
            for k, v in state["model"].items()
        }
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    if len(groups) > 1:
        (dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
        )


def _as_saved(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.contiguous()


def export_checkpoint(
    checkpoint: str | Path, role: str, out_dir: str | Path, shard_bytes: int = SHARD_BYTES
) -> Path:
    checkpoint, out = Path(checkpoint), Path(out_dir).resolve()
    if role not in ROLES:
        raise ExportError(f"--role must be actor or critic, not {role!r}")
    check_checkpoint(checkpoint, role)
    check_output(out)
    run_cfg = saved_run_config(checkpoint)  # the run's config.yaml, saved with the checkpoint
    side = _side_folder(checkpoint, run_cfg)
    if role == "critic":
        config_folder = _critic_config_folder(checkpoint, run_cfg, side)
    else:
        config_folder = side
    config = _hf_config(role, config_folder)

    tmp = staging_folder(out)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an export that was killed
    try:
        copy_side_files(side, tmp)  # the run's tokenizer, whichever model the role started from
        if role == "critic":
            config.save_pretrained(tmp)
            (tmp / "generation_config.json").unlink(missing_ok=True)
        _write_weights(checkpoint / role, role, tmp, config, shard_bytes)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
