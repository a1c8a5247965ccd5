"""`meshrl export CHECKPOINT --role actor|critic --to DIR`: a step checkpoint to a Hugging
Face folder (config, safetensors, tokenizer, generation config).

The trainer's shards are read straight from the torch.distributed.checkpoint files a
group of tensors at a time and written as safetensors shards, so no process ever holds
the whole model: the export works the same for a model saved by 1 rank or by 64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig

from services.coordinator.checkpointing import verify

# Small files of a model folder that describe it (not weights).
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
SHARD_BYTES = 2 * 1024**3


class ExportError(ValueError):
    pass


def copy_side_files(model_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)


def _rename(role: str, key: str) -> str | None:
    """DCP key -> Hugging Face name. actor: `model.<hf name>`; critic: decoder + value head
    become a `*ForTokenClassification` with one label (`score` = value head)."""
    if not key.startswith("model."):
        return None  # optimizer state
    name = key[len("model.") :]
    if role == "critic":
        if name.startswith("value_head."):
            return "score." + name[len("value_head.") :]
        return name  # "model.layers..." is already the decoder's name inside the classifier
    return name


def _groups(items: list[tuple[str, TensorStorageMetadata]], limit: int):
    group, size = [], 0
    for key, meta in items:
        nbytes = meta.size.numel() * torch.empty(0, dtype=meta.properties.dtype).element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append((key, meta))
        size += nbytes
    if group:
        yield group


def export_checkpoint(
    checkpoint: str | Path, role: str, out_dir: str | Path, shard_bytes: int = SHARD_BYTES
) -> Path:
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if role not in ("actor", "critic"):
        raise ExportError(f"--role must be actor or critic, not {role!r}")
    verify(checkpoint)
    shards_dir = checkpoint / role
    if not shards_dir.is_dir():
        raise ExportError(f"{checkpoint} holds no {role}/ folder")
    side = checkpoint / "hf"
    if not (side / "config.json").is_file():  # older checkpoint: use the run's model folder
        run_cfg = yaml.safe_load((checkpoint / "config.yaml").read_text())
        side = Path(run_cfg["actor_rollout_ref"]["model"]["path"])
    copy_side_files(side, out)
    if role == "critic":
        config = AutoConfig.from_pretrained(out)
        base = config.architectures[0].replace("ForCausalLM", "")
        config.architectures = [f"{base}ForTokenClassification"]
        config.num_labels = 1
        config.save_pretrained(out)
        (out / "generation_config.json").unlink(missing_ok=True)

    reader = dcp.FileSystemReader(str(shards_dir))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = [
        (k, m)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata) and _rename(role, k) is not None
    ]
    index: dict[str, str] = {}
    groups = list(_groups(tensors, shard_bytes))
    for i, group in enumerate(groups):
        state = {
            "model": {
                k[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in group
            }
        }
        dcp.load(state, storage_reader=reader, no_dist=True)
        name = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        shard = {_rename(role, "model." + k): v.contiguous() for k, v in state["model"].items()}
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
    if len(groups) > 1:
        total = sum(
            m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
            for _, m in tensors
        )
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
        )
    return out
