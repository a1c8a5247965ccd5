"""A model section (``actor_rollout_ref.model``, ``critic.model``): its folder, dtype and LoRA."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from meshrl.config.sections.base import PathText, Section, dtype_name


class ModelConfig(Section):
    path: PathText = ""
    """Hugging Face model folder (config, weights, tokenizer), or a hub id (org/name),
    downloaded into the hub cache before any role server starts (``HF_HUB_OFFLINE=1``:
    the cache alone)."""
    tokenizer_path: PathText | None = None
    """Tokenizer folder (or hub id) if not the model's."""
    enable_gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward instead of keeping them (the
    activations of a micro-batch shrink to one layer's, for about a third more update
    compute). None: on with trainer.device=cuda (verl's default, true), off on the CPU."""
    dtype: Annotated[Literal["float32", "bfloat16"], BeforeValidator(dtype_name)] | None = None
    """Compute dtype of the trainer (master weights stay float32). None: for
    actor_rollout_ref.model (actor, reference), bfloat16 with trainer.device=cuda (as
    verl's, FSDP2 mixed precision) and float32 on the CPU; the actor's for critic.model."""
    use_remove_padding: bool = False
    """Padding-free forwards: each micro-batch is one row of its sequences back to back,
    attention kept inside each (varlen attention; see docs/trainer.md)."""
    lora_rank: int = Field(0, ge=0)
    """LoRA adapters of this rank on ``target_modules`` of the trained role (actor or
    critic); the base weights are frozen. 0: every weight is trained. The reference always
    scores with the base model; rollout gets the merged weights (docs/trainer.md)."""
    lora_alpha: float = Field(16, gt=0)
    """LoRA's scale numerator: the adapter's update is multiplied by lora_alpha/lora_rank."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters, as peft matches them: a list of name suffixes ([q_proj,
    v_proj]), "all-linear" (every linear layer but the LM head), one name (q_proj, read as
    [q_proj]), or any other string as a regular expression over whole module names. Plain
    linear layers only: an embedding or a Conv1D is refused at start."""
    exclude_modules: str | list[str] | None = None
    """Layers left without adapters, read as target_modules is."""
