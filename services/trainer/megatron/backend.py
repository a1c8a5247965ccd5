"""The Megatron-Core backend (``strategy=megatron``): a role's model built from a Hugging
Face folder as a Megatron GPTModel, its weights read out under Hugging Face names (for
weight sync and checkpoints), split over ``tensor_model_parallel_size`` ranks (Megatron's
tensor parallelism) and data parallel over the rest of the role's ranks.

Tensor parallelism: each rank loads its shard of every split weight (``mapping.shard``);
weight sync, export and checkpoints gather each tensor over the tensor-parallel group and
see the full Hugging Face tensors, as with one rank (docs/megatron.md).

Only this package imports megatron-core (an optional extra: ``pip install .[megatron]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state, tensor_parallel
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM

from meshrl.config.schema import RunConfig
from meshrl.config.sections.megatron import MegatronConfig, tensor_split_problems
from meshrl.model_files import naming_bad_weights
from services.trainer.checkpoint import read_meta, write_meta
from services.trainer.distributed import World
from services.trainer.megatron.mapping import (
    AttentionShape,
    from_hf,
    full_shape,
    shard,
    split_dim,
    to_hf,
    unshard,
)
from services.trainer.megatron.model import MegatronLM, build_gpt, on_cpu
from services.trainer.optim import SPLIT_OVER

NAME = "megatron"


def policy_model(cfg: RunConfig, world: World, trained: bool) -> MegatronLM:
    """The actor's (``trained``) or the reference's causal LM, on the role's device."""
    arr = cfg.actor_rollout_ref
    section = arr.actor if trained else arr.ref
    recompute = trained and bool(arr.model.enable_gradient_checkpointing)
    key = "actor_rollout_ref.actor" if trained else "actor_rollout_ref.ref"
    return _model(arr.model.path, arr.model.dtype, section.megatron, world, recompute, trained,
                  value_head=False, seed=cfg.trainer.seed, key=key)  # fmt: skip


def value_model(cfg: RunConfig, world: World) -> MegatronLM:
    c = cfg.critic
    path = c.model.path or cfg.actor_rollout_ref.model.path
    dtype = c.model.dtype or cfg.actor_rollout_ref.model.dtype
    recompute = bool(c.model.enable_gradient_checkpointing)
    return _model(path, dtype, c.megatron, world, recompute, True, value_head=True,
                  seed=cfg.trainer.seed, key="critic")  # fmt: skip


def _model(
    path: str, dtype: str | None, sizes: MegatronConfig, world: World, recompute: bool,
    trained: bool, value_head: bool, seed: int, key: str,
) -> MegatronLM:  # fmt: skip
    """``key``: the role's section, named in a refusal."""
    if not path or not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a local Hugging Face folder")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    tp = sizes.tensor_model_parallel_size
    counts = {"num_attention_heads": hf_config.num_attention_heads,
              "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None),
              "vocab_size": hf_config.vocab_size}  # fmt: skip
    where = str(Path(path) / "config.json")
    if problems := tensor_split_problems(f"{key}.megatron.tensor_model_parallel_size", tp,
                                         counts, where):  # fmt: skip
        raise ValueError("; ".join(problems))
    init_parallel(sizes, world, seed)
    gpt = build_gpt(hf_config, recompute, with_lm_head=not value_head, tensor_parallel=tp)
    if world.device.type == "cpu":
        on_cpu(gpt)
    compute = torch.bfloat16 if dtype in ("bfloat16", "bf16") else None
    model = MegatronLM(gpt, hf_config, compute, value_head)
    load_hf_weights(model, path)
    model.to(world.device)
    if tp > 1:  # the gradient norm sums these shards' squares over the group (optim.py)
        group = parallel_state.get_tensor_model_parallel_group()
        for name, param in _gpt_params(model):
            if split_dim(name) is not None:
                setattr(param, SPLIT_OVER, group)
    if not trained:
        model.requires_grad_(False)
        model.eval()
    elif parallel_state.get_data_parallel_world_size() > 1:
        model.data_parallel(world.device, parallel_state.get_data_parallel_group())
    return model


def init_parallel(sizes: MegatronConfig, world: World, seed: int) -> None:
    """Megatron's process groups over the default one (tensor x pipeline x data), once per
    process: every Megatron role of a process must ask for the same sizes."""
    tp, pp = sizes.tensor_model_parallel_size, sizes.pipeline_model_parallel_size
    if world.world_size % (tp * pp):  # the config refuses it; here for a bare world
        raise ValueError(
            f"megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} "
            f"does not divide the {world.world_size} running ranks"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have != (tp, pp):
        raise ValueError(
            f"megatron.tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}: "
            f"this process's Megatron groups are already {have[0]} and {have[1]} (another "
            "role of the process): give its Megatron roles the same sizes"
        )
    if world.device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def data_world(model: MegatronLM, world: World) -> World:
    """The ranks the batch is split over: Megatron's data-parallel ones (each
    tensor-parallel group computes one share together)."""
    return world.data_parallel(
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_group(),
    )


def _tensor_parallel() -> tuple[int, int]:
    """(size, this rank's place) of the tensor-parallel group."""
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _gathered(name: str, local: torch.Tensor) -> torch.Tensor:
    """The full Megatron tensor of a parameter (or of a moment of the optimizer's, which
    is split as its parameter) from every tensor-parallel rank's part: a collective of
    the group; a replicated tensor is returned as it is."""
    tp, _ = _tensor_parallel()
    if tp == 1 or split_dim(name) is None:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return unshard(name, parts)


def _gpt_params(model: MegatronLM) -> list[tuple[str, torch.nn.Parameter]]:
    """(Megatron name, parameter) of the decoder, then the value head's (``value_head.*``)."""
    named = [(n, p) for n, p in model.gpt.named_parameters()]
    head = getattr(model.inner, "value_head", None)
    if head is not None:
        named += [(f"value_head.{n}", p) for n, p in head.named_parameters()]
    return named


@torch.no_grad()
def load_hf_weights(model: MegatronLM, path: str) -> None:
    """Every decoder weight from the folder (float32); a critic's value head stays zero."""
    with naming_bad_weights(path):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    state = hf.state_dict()
    shape = AttentionShape.of(model.config)
    names = [n for n, _ in _gpt_params(model) if not n.startswith("value_head.")]
    params = dict(_gpt_params(model))
    tp, rank = _tensor_parallel()
    for name, full in from_hf(names, state, shape):
        tensor = shard(name, full, tp, rank)
        if params[name].shape != tensor.shape:
            raise ValueError(f"{path}: {name} is {tuple(tensor.shape)}, the model's "
                             f"{tuple(params[name].shape)}")  # fmt: skip
        params[name].copy_(tensor)
    del hf, state


def full_params(model: MegatronLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor), one Megatron parameter at a time: the mapping runs
    on the fly, so weight sync never holds a second copy of the model. With tensor
    parallelism each split parameter is gathered over the group first (a collective:
    every rank drains this iterator in step); with size 1 nothing is gathered."""
    shape = AttentionShape.of(model.config)
    for name, param in _gpt_params(model):
        with torch.no_grad():
            yield from to_hf(name, _gathered(name, param.detach()), shape)


def full_shapes(model: MegatronLM) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes, in :func:`full_params` order (no tensor is copied)."""
    shape = AttentionShape.of(model.config)
    tp, _ = _tensor_parallel()
    return [
        (hf, tuple(t.shape))
        for name, p in _gpt_params(model)
        for hf, t in to_hf(name, torch.empty(full_shape(name, p.shape, tp), device="meta"), shape)
    ]


def save_checkpoint(
    path: str, model: MegatronLM, optimizer: torch.optim.Optimizer | None, meta: dict
) -> None:
    """DCP, as the FSDP2 backend's, with the model under Hugging Face names (``model.<hf
    name>``): ``meshrl export`` reads it as it reads an FSDP2 checkpoint. The optimizer's
    moments stay under Megatron's names (their tensors are the fused ones).

    Every tensor is saved whole, whatever the tensor-parallel size (the split ones gathered
    over the group, the moments as their parameters): a checkpoint loads at any size."""
    Path(path).mkdir(parents=True, exist_ok=True)
    state: dict = {"model": {n: t for n, t in full_params(model)}}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer, gather=True)
    dcp.save(state, checkpoint_id=str(path))
    write_meta(path, meta, with_optimizer=optimizer is not None)


_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def _megatron_name(fqn: str) -> str:
    """A parameter's name in the optimizer's state dict (``model.inner``'s) -> Megatron's."""
    return fqn.removeprefix("gpt.")


def _optimizer_state(model: MegatronLM, optimizer: torch.optim.Optimizer, gather: bool) -> dict:
    """The optimizer's state dict with the moments of split parameters full: gathered
    (``gather``, to save) or empty tensors of the full shape (to load into). New dicts:
    torch's state dict holds the optimizer's own moments."""
    state = get_optimizer_state_dict(model.inner, optimizer, options=_OPTIONS)
    tp, _ = _tensor_parallel()
    if tp == 1:
        return state

    def full(name: str, t: torch.Tensor) -> torch.Tensor:
        if gather:
            return _gathered(name, t)
        return t.new_empty(full_shape(name, tuple(t.shape), tp))

    return {**state, "state": _map_moments(cast(dict, state["state"]), full)}


def _sharded_optimizer_state(state: dict) -> dict:
    """The inverse of :func:`_optimizer_state`'s gathering: this rank's part of each moment."""
    tp, rank = _tensor_parallel()
    if tp == 1:
        return state
    parts = _map_moments(state["state"], lambda name, t: shard(name, t, tp, rank))
    return {**state, "state": parts}


def _map_moments(moments: dict, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> dict:
    """``{fqn: {"exp_avg": t, "exp_avg_sq": t, "step": s}}`` with ``fn(Megatron name, t)`` for
    the moments of split parameters (the step counts and the replicated ones as they are)."""
    out = {}
    for fqn, per_param in moments.items():
        name = _megatron_name(fqn)
        split = split_dim(name) is not None
        out[fqn] = {
            key: fn(name, t) if split and key != "step" else t for key, t in per_param.items()
        }
    return out


def load_checkpoint(
    path: str,
    model: MegatronLM,
    optimizer: torch.optim.Optimizer | None,
    check: Callable[[dict], None] | None = None,
) -> dict:
    """Loads a checkpoint of :func:`save_checkpoint` saved at any tensor-parallel size:
    each rank reads the whole tensors and keeps its part."""
    meta = read_meta(path, check, with_optimizer=optimizer is not None)
    device = next(p.device for _, p in _gpt_params(model))
    state: dict = {
        "model": {
            n: torch.empty(shape, dtype=torch.float32, device=device)
            for n, shape in full_shapes(model)
        }
    }
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer, gather=False)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException: see checkpoint.load_checkpoint
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} does not fit this role's model: {first}") from None
    params = dict(_gpt_params(model))
    tp, rank = _tensor_parallel()
    with torch.no_grad():
        for name, tensor in from_hf(list(params), state["model"], AttentionShape.of(model.config)):
            params[name].copy_(shard(name, tensor, tp, rank))
    if optimizer is not None:
        state["optimizer"] = _sharded_optimizer_state(state["optimizer"])
        set_optimizer_state_dict(model.inner, optimizer, state["optimizer"], options=_OPTIONS)
    return meta
