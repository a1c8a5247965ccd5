"""The FSDP2 backend (``strategy`` fsdp or fsdp2): Hugging Face models from the folder,
LoRA adapters when asked, each sharded with ``fully_shard`` over the role's ranks
(``sharding.py``); weights read out gathered one parameter at a time, adapters merged;
checkpoints with DCP (``services/trainer/checkpoint.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from meshrl.config.schema import RunConfig
from services.trainer.checkpoint import load_checkpoint, save_checkpoint
from services.trainer.critic import compute_dtype
from services.trainer.distributed import World
from services.trainer.fsdp.sharding import mixed_precision, reshard, shard_model
from services.trainer.lora import add_lora, iter_merged_params, named_full_shapes
from services.trainer.model_loading import freeze, load_policy_model, load_value_model

NAME = "fsdp"
__all__ = ["NAME", "data_world", "full_params", "full_shapes", "load_checkpoint", "policy_model",
           "save_checkpoint", "value_model"]  # fmt: skip


def policy_model(cfg: RunConfig, world: World, trained: bool) -> nn.Module:
    """The actor's (``trained``: LoRA adapters when asked, float32 masters) or the
    reference's (frozen; its weights in pinned CPU memory with ``ref.param_offload``)."""
    arr = cfg.actor_rollout_ref
    if not trained:
        model = freeze(
            load_policy_model(
                arr.model.path, world.device, remove_padding=arr.model.use_remove_padding
            )
        )
        # Frozen weights still shard: the reference is as large as the actor.
        return shard_model(
            model,
            world.mesh,
            mixed_precision(arr.model.dtype),
            compile_layers=bool(arr.ref.use_torch_compile),
            offload=arr.ref.param_offload and world.device.type == "cuda",
        )
    model = load_policy_model(
        arr.model.path,
        "cpu",
        bool(arr.model.enable_gradient_checkpointing),
        arr.model.use_remove_padding,
    )
    # Before sharding (FSDP2 shards what it finds), on the CPU (the same draw on every rank).
    model = add_lora(model, arr.model, cfg.trainer.seed, "actor_rollout_ref.model")
    return shard_model(
        model.to(world.device),
        world.mesh,
        mixed_precision(arr.model.dtype),
        compile_layers=bool(arr.actor.use_torch_compile),
    )


def value_model(cfg: RunConfig, world: World) -> nn.Module:
    """The critic: the folder's decoder and a zero value head (``ValueModel``)."""
    c = cfg.critic
    path = c.model.path or cfg.actor_rollout_ref.model.path
    model = load_value_model(
        path, "cpu", bool(c.model.enable_gradient_checkpointing), c.model.use_remove_padding
    )
    # On the decoder (the value head stays fully trained), on the CPU: as the actor's.
    add_lora(model.model, c.model, cfg.trainer.seed, "critic.model")
    return shard_model(
        model.to(world.device),
        world.mesh,
        mixed_precision(compute_dtype(cfg)),
        compile_layers=bool(c.use_torch_compile),
    )


def data_world(model: nn.Module, world: World) -> World:
    """FSDP2 shards each unit over all the role's ranks: every one takes its share."""
    return world


def full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor), one parameter at a time, adapters merged. Each
    gather is a collective: every rank must drain this iterator in step."""
    reshard(model)  # the float32 masters, whatever a forward left gathered
    yield from iter_merged_params(model)


def full_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and full (un-sharded) shapes, in :func:`full_params` order."""
    return named_full_shapes(model)
