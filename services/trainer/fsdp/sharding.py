"""FSDP2 as a transform on a plain module: each decoder layer is one shard unit, the rest
(embeddings, final norm, heads) belongs to the root unit.

Works on one rank too (the "shards" are then whole), so one code path serves both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypedDict, TypeVar, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


class _ShardOptions(TypedDict, total=False):
    """The keyword arguments of ``fully_shard`` that :func:`shard_model` sets."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


def mixed_precision(dtype: str | None) -> MixedPrecisionPolicy | None:
    """bf16 compute over float32 master weights: parameters are gathered and cast to
    bf16 for forward/backward, gradients reduced in float32 and kept with the float32
    shards the optimizer updates. None (pure float32) for "float32"."""
    if dtype in ("bfloat16", "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if dtype in ("float32", "fp32", "", None):
        return None
    raise ValueError(f"model.dtype {dtype!r}: expected float32 or bfloat16")


def shard_model(
    model: M,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    compile_layers: bool = False,
    units: str | None = None,
    offload: bool = False,
) -> M:
    """Applies ``fully_shard`` to every decoder layer, then to the root; returns ``model``.

    ``compile_layers`` (the role's ``use_torch_compile``) torch.compiles each decoder
    layer first. ``units``: "layer" shards each decoder layer as
    its own unit (gathered just before it runs: the least memory), "model" the whole model
    as one unit (one gather per forward and one reduce per backward instead of hooks around
    every layer: less host time, the whole model's compute-dtype weights held at once).
    ``reshard_after_forward`` None: False for one unit (its gathered weights are what the
    backward needs next: gathering them again only repeats the work; forward-only passes
    free them with :func:`resharded`), True for per-layer units.
    None: ``MESHRL_FSDP_UNITS`` if set, else "model" on one rank (nothing is sharded there
    anyway; on the H200 the actor update ran 1.25x faster) and "layer" on several. Parameter names are unchanged (FSDP2 swaps
    parameters for DTensors in place), so ``named_parameters()`` still gives Hugging Face
    names with full shapes.

    ``offload`` keeps the sharded parameters in pinned CPU memory (``CPUOffloadPolicy``):
    each unit's are copied to the GPU when it is gathered and freed when it reshards. For a
    frozen, forward-only role (the reference); on a CPU mesh it changes nothing.
    """
    units = (
        units or os.environ.get("MESHRL_FSDP_UNITS") or ("model" if mesh.size() == 1 else "layer")
    )
    if units not in ("layer", "model"):
        raise ValueError(f"FSDP units {units!r}: expected 'layer' or 'model'")
    if reshard_after_forward is None:
        reshard_after_forward = units == "layer"
    kwargs: _ShardOptions = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload and mesh.device_type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    layer_types = _decoder_layer_types(model)
    for module in model.modules():
        if type(module).__name__ in layer_types:
            if compile_layers:
                # Each block compiled on its own (one graph, reused by every block), then
                # sharded: FSDP's gathers stay outside the compiled code.
                module.compile()
            if units == "layer":
                fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


# On one rank, the gathered weights are kept from a role's forward-only pass (old log-probs,
# values) into its update, and from one mini-batch to the next (gathered_across_steps).
KEEP_GATHERED_ON_ONE_RANK = True


def keeps_gathered(world_size: int) -> bool:
    """Whether a role on ``world_size`` ranks keeps its gathered weights between passes."""
    return KEEP_GATHERED_ON_ONE_RANK and world_size == 1


@contextmanager
def resharded(model: nn.Module, keep: bool = False) -> Iterator[None]:
    """Frees the gathered weights of ``model``'s FSDP units when the block ends: for
    forward-only passes, where no backward reshards what a unit kept gathered after its
    forward (``reshard_after_forward=False``). Until then, micro-batches reuse one gather;
    after, ``named_parameters()`` are the sharded float32 masters again.

    ``keep`` leaves them gathered, for a role whose update follows (one rank,
    :func:`keeps_gathered`): the update's first forward then needs no gather, and the
    update frees them when it ends; weight sync and checkpoints reshard first anyway.
    Nothing changes the masters in between (only an update steps them)."""
    try:
        yield
    finally:
        if not keep:
            reshard(model)


def reshard(model: nn.Module) -> None:
    """Frees every FSDP unit's gathered weights (none gathered: nothing happens)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _decoder_layer_types(model: nn.Module) -> set[str]:
    """Class names of the repeated blocks, as every Hugging Face model lists them."""
    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            names.update(module._no_split_modules or [])
    if not names:
        raise ValueError(
            f"{type(model).__name__} lists no decoder layer classes (_no_split_modules)"
        )
    return names


@contextmanager
def gathered_across_steps(model: nn.Module, enabled: bool) -> Iterator[Callable[[], None]]:
    """Within the block, the gathered compute-dtype weights outlive each backward, and the
    yielded ``refresh()`` (call it after every optimizer step) writes the stepped float32
    masters into them in one foreach copy. When the block ends they are freed.

    Only on one rank (``enabled``), where a "shard" is the whole tensor: FSDP2 gathers a
    one-rank unit parameter by parameter (a cast and a copy each, ~300 for a 0.5B model),
    host work the GPU waits for at the start of every mini-batch's forward; the foreach
    copy is a few launches. Not enabled: an empty block, ``refresh()`` does nothing.
    """
    if not enabled:
        yield lambda: None
        return
    modules: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_reshard_after_backward(False, recurse=False)

    in_place = True

    def refresh() -> None:
        nonlocal in_place
        if in_place:
            try:
                _copy_masters_to_gathered(modules)
                return
            except AttributeError as e:
                # The copy reads FSDP2 internals (a unit's param group, each parameter's
                # gathered tensor) that a torch release may rename. Then free the gathered
                # weights instead: the next forward gathers the stepped masters.
                log.warning(
                    "FSDP2 internals not found (%s): the weights are gathered again after "
                    "each optimizer step instead of refreshed in place",
                    e,
                )
                in_place = False
        reshard(model)

    try:
        yield refresh
    finally:
        for module in modules:
            module.set_reshard_after_backward(True, recurse=False)
        reshard(model)


@torch.no_grad()
def _copy_masters_to_gathered(modules: list[FSDPModule]) -> None:
    """For every gathered unit of ``modules`` (one rank), master -> gathered copy (cast to
    the compute dtype as FSDP2's gather casts). Units not gathered are left alone: their
    next forward gathers the masters anyway. Reads FSDP2's private attributes (no public
    API reaches the gathered tensors); nothing is written unless all of them are found."""
    gathered: list[torch.Tensor] = []
    masters: list[torch.Tensor] = []
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or not group.is_unsharded:
            continue
        for param in group.fsdp_params:
            if not param.sharded_param.requires_grad:
                continue  # frozen (LoRA's base weights): its gathered copy is still current
            # FSDP2 annotates sharded_param as nn.Parameter; it is a DTensor parameter.
            master = cast(DTensor, param.sharded_param).to_local()
            if master.shape != param._unsharded_param.shape:
                raise RuntimeError(
                    f"{param._param_fqn}: shard {tuple(master.shape)} is not the whole "
                    f"{tuple(param._unsharded_param.shape)}; gathered_across_steps needs one rank"
                )
            gathered.append(param._unsharded_param)
            masters.append(master)
    if gathered:
        torch._foreach_copy_(gathered, masters)
