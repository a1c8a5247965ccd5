"""The Megatron-Core trainer backend's config: the `megatron` section of the actor, critic
and reference (verl's names), and the start-up checks of ``strategy=megatron``.

Kept in one module so that the schema gains three fields and one call, nothing else
(docs/megatron.md).
"""

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
    """Ranks one layer's matmuls are split over (Megatron's tensor parallelism). Only 1 runs
    yet; world_size / (tensor * pipeline sizes) ranks are data parallel."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Stages the layers are split into (Megatron's pipeline parallelism). Only 1 runs yet."""
    context_parallel_size: int = Field(1, ge=1, le=1)
    """verl's key; only 1 (no context parallelism)."""
    expert_model_parallel_size: int = Field(1, ge=1, le=1)
    """verl's key; only 1 (dense models: no experts)."""
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1, le=1)
    """verl's key; null or 1 (no interleaved pipeline)."""


# What runs now: more would need sharded weight loading, export and checkpoints per rank
# (docs/megatron.md, "Not yet").
RUNNING_SIZES = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def megatron_problems(
    section: str, strategy: str, megatron: MegatronConfig, world_size: int, lora_rank: int,
    remove_padding: bool,
) -> list[str]:  # fmt: skip
    """One line per setting ``strategy=megatron`` cannot run with, for ``section``
    (``actor_rollout_ref.actor``, ``critic``, ``actor_rollout_ref.ref``); none for FSDP."""
    if strategy != "megatron":
        return []
    problems = []
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if world_size % (tp * pp):
        problems.append(
            f"{section}.megatron.tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} does not divide {section}.world_size="
            f"{world_size}: the role's ranks cannot be split so"
        )
    for key, running in RUNNING_SIZES.items():
        value = getattr(megatron, key)
        if value != running:
            problems.append(
                f"{section}.megatron.{key}={value}: meshrl's Megatron backend runs only "
                f"{running} yet (docs/megatron.md)"
            )
    model = "actor_rollout_ref.model" if section != "critic" else "critic.model"
    if lora_rank:
        problems.append(
            f"{model}.lora_rank={lora_rank} does not go with {section}.strategy=megatron "
            "(LoRA adapters are peft's, on the FSDP2 backend): set strategy=fsdp2"
        )
    if remove_padding:
        problems.append(
            f"{model}.use_remove_padding=true does not go with {section}.strategy=megatron "
            "(padding-free rows need varlen attention, which the Megatron backend's torch "
            "attention has not): set use_remove_padding=false"
        )
    return problems
