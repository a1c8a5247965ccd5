"""The trainer backend of a role (verl's `strategy`) and the Megatron-Core backend's
`megatron` section of the actor, critic and reference (verl's names); what strategy=megatron
goes with is a rule of meshrl/config/rules.py (docs/megatron.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _strategy_name(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


# verl's `strategy` of the actor, critic and reference: "fsdp" (FSDP1 there) and "fsdp2" both
# run as FSDP2 here (services/trainer/fsdp/); "megatron" as Megatron-Core
# (services/trainer/megatron/). The registry of backends is services/trainer/backends.py.
Strategy = Annotated[Literal["fsdp", "fsdp2", "megatron"], BeforeValidator(_strategy_name)]


class MegatronConfig(BaseModel):
    """verl's `<role>.megatron` section: how a Megatron-Core role splits its model."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tensor_model_parallel_size: int = Field(1, ge=1)
    """Ranks one layer's matmuls are split over (Megatron's tensor parallelism); it must
    divide the role's world_size and the model's attention heads, KV heads and vocabulary.
    world_size / (tensor * pipeline sizes) ranks are data parallel."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Stages the layers are split into (Megatron's pipeline parallelism). Only 1 runs yet."""
    context_parallel_size: int = Field(1, ge=1, le=1)
    """verl's key; only 1 (no context parallelism)."""
    expert_model_parallel_size: int = Field(1, ge=1, le=1)
    """verl's key; only 1 (dense models: no experts)."""
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1, le=1)
    """verl's key; null or 1 (no interleaved pipeline)."""


# What runs now: pipeline stages would need Megatron's pipeline schedule around the roles'
# forwards and losses (docs/megatron.md, "Not yet").
RUNNING_SIZES = {"pipeline_model_parallel_size": 1}

# config.json's key -> what it counts: what tensor parallelism splits evenly over its ranks.
_SPLIT_COUNTS = {
    "num_attention_heads": "attention heads",
    "num_key_value_heads": "KV heads",
    "vocab_size": "vocabulary entries",
}


def tensor_split_problems(key: str, tp: int, model_config: dict, where: str) -> list[str]:
    """One line for each count of a model's config.json (``model_config``, read from
    ``where``) that ``tp`` tensor-parallel ranks cannot split evenly; ``key`` is the role's
    ``<section>.megatron.tensor_model_parallel_size``."""
    counts = dict(model_config)
    counts.setdefault("num_key_value_heads", counts.get("num_attention_heads"))
    return [
        f"{key}={tp} does not divide the model's {counts[name]} {what} ({name} of {where})"
        for name, what in _SPLIT_COUNTS.items()
        if isinstance(counts.get(name), int) and counts[name] % tp
    ]
