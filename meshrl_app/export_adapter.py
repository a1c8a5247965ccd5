"""`meshrl export CHECKPOINT --adapter --to DIR`: a LoRA actor's adapters alone, as a peft
adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), to load on the
base model with ``PeftModel.from_pretrained`` or serve beside it (vLLM's LoRA support).

The merged export (`meshrl export` without ``--adapter``) needs no peft; this one is a few
MB instead of the whole model. Only the actor: a critic's adapters are useless without its
value head, which no peft task type carries.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshrl_app.export import (
    ExportError,
    check_checkpoint,
    check_output,
    configured_path,
    publish,
    read_shards,
    saved_run_config,
    staging_folder,
)
from services.trainer.checkpoint import META_FILE
from services.trainer.lora import ADAPTER

PEFT_PREFIX = "base_model.model."  # how a PeftModel names its wrapped model's weights


def peft_key(name: str) -> str:
    """A trainer parameter's name -> the key peft saves it under (no adapter name)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def _lora_meta(shards_dir: Path, checkpoint: Path) -> dict:
    meta_file = shards_dir / META_FILE
    lora = json.loads(meta_file.read_text()).get("lora") if meta_file.is_file() else None
    if lora is None:
        raise ExportError(
            f"the actor of {checkpoint} was trained without LoRA adapters "
            "(actor_rollout_ref.model.lora_rank 0): export the whole model, without --adapter"
        )
    return lora


def export_adapter(checkpoint: str | Path, out_dir: str | Path) -> Path:
    checkpoint, out = Path(checkpoint), Path(out_dir).resolve()
    check_checkpoint(checkpoint, "actor")
    check_output(out)
    shards = checkpoint / "actor"
    lora = _lora_meta(shards, checkpoint)
    reader = dcp.FileSystemReader(str(shards))
    metadata = reader.read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith("model.") and (".lora_A." in k or ".lora_B." in k)]
    adapters = {k: cast(TensorStorageMetadata, metadata[k]) for k in keys}  # tensors, all
    state = {
        "model": {
            k[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in adapters.items()
        }
    }
    read_shards(state, reader)  # without torch's "torch.distributed is disabled" warning
    tensors = {peft_key(name): t.contiguous() for name, t in state["model"].items()}
    # The layers that carry adapters, by the suffix peft matches (q_proj, down_proj, ...).
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state["model"]})
    base = configured_path(saved_run_config(checkpoint), "actor_rollout_ref", "model", "path")
    config = LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=lora["alpha"],
        target_modules=targets,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )

    tmp = staging_folder(out)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an export that was killed
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
