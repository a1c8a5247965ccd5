"""The Megatron-Core backend (``strategy=megatron``): a role's model built from a Hugging
Face folder as a Megatron GPTModel, its weights read out under Hugging Face names (for
weight sync and checkpoints), data parallel over the role's ranks.

Only this package imports megatron-core (an optional extra: ``pip install .[megatron]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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
from meshrl.config.sections.megatron import MegatronConfig
from meshrl.model_files import naming_bad_weights
from services.trainer.checkpoint import read_meta, write_meta
from services.trainer.distributed import World
from services.trainer.megatron.mapping import AttentionShape, from_hf, to_hf
from services.trainer.megatron.model import MegatronLM, build_gpt, on_cpu

NAME = "megatron"


def policy_model(cfg: RunConfig, world: World, trained: bool) -> MegatronLM:
    """The actor's (``trained``) or the reference's causal LM, on the role's device."""
    arr = cfg.actor_rollout_ref
    section = arr.actor if trained else arr.ref
    recompute = trained and bool(arr.model.enable_gradient_checkpointing)
    return _model(arr.model.path, arr.model.dtype, section.megatron, world, recompute, trained,
                  value_head=False, seed=cfg.trainer.seed)  # fmt: skip


def value_model(cfg: RunConfig, world: World) -> MegatronLM:
    c = cfg.critic
    path = c.model.path or cfg.actor_rollout_ref.model.path
    dtype = c.model.dtype or cfg.actor_rollout_ref.model.dtype
    recompute = bool(c.model.enable_gradient_checkpointing)
    return _model(path, dtype, c.megatron, world, recompute, True, value_head=True,
                  seed=cfg.trainer.seed)  # fmt: skip


def _model(
    path: str, dtype: str | None, sizes: MegatronConfig, world: World, recompute: bool,
    trained: bool, value_head: bool, seed: int,
) -> MegatronLM:  # fmt: skip
    init_parallel(sizes, world, seed)
    if not path or not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a local Hugging Face folder")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    gpt = build_gpt(hf_config, recompute, with_lm_head=not value_head)
    if world.device.type == "cpu":
        on_cpu(gpt)
    compute = torch.bfloat16 if dtype in ("bfloat16", "bf16") else None
    model = MegatronLM(gpt, hf_config, compute, value_head)
    load_hf_weights(model, path)
    model.to(world.device)
    if not trained:
        model.requires_grad_(False)
        model.eval()
    elif world.world_size > 1:
        model.data_parallel(world.device)
    return model


def init_parallel(sizes: MegatronConfig, world: World, seed: int) -> None:
    """Megatron's process groups over the default one (tensor x pipeline x data), once."""
    tp, pp = sizes.tensor_model_parallel_size, sizes.pipeline_model_parallel_size
    if world.world_size % (tp * pp):  # the config refuses it; here for a bare world
        raise ValueError(
            f"megatron.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} "
            f"does not divide the {world.world_size} running ranks"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    if world.device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


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
    for name, tensor in from_hf(names, state, shape):
        if params[name].shape != tensor.shape:
            raise ValueError(f"{path}: {name} is {tuple(tensor.shape)}, the model's "
                             f"{tuple(params[name].shape)}")  # fmt: skip
        params[name].copy_(tensor)
    del hf, state


def full_params(model: MegatronLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor), one Megatron parameter at a time: the mapping runs
    on the fly, so weight sync never holds a second copy of the model. With tensor and
    pipeline sizes 1 every rank holds every tensor: nothing to gather."""
    shape = AttentionShape.of(model.config)
    for name, param in _gpt_params(model):
        with torch.no_grad():
            yield from to_hf(name, param.detach(), shape)


def full_shapes(model: MegatronLM) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and shapes, in :func:`full_params` order (no tensor is copied)."""
    shape = AttentionShape.of(model.config)
    return [
        (hf, tuple(t.shape))
        for name, p in _gpt_params(model)
        for hf, t in to_hf(name, torch.empty(p.shape, device="meta"), shape)
    ]


def save_checkpoint(
    path: str, model: MegatronLM, optimizer: torch.optim.Optimizer | None, meta: dict
) -> None:
    """DCP, as the FSDP2 backend's, with the model under Hugging Face names (``model.<hf
    name>``): ``meshrl export`` reads it as it reads an FSDP2 checkpoint. The optimizer's
    moments stay under Megatron's names (their tensors are the fused ones)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    state: dict = {"model": {n: t for n, t in full_params(model)}}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model.inner, optimizer, options=_OPTIONS)
    dcp.save(state, checkpoint_id=str(path))
    write_meta(path, meta, with_optimizer=optimizer is not None)


_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def load_checkpoint(
    path: str,
    model: MegatronLM,
    optimizer: torch.optim.Optimizer | None,
    check: Callable[[dict], None] | None = None,
) -> dict:
    meta = read_meta(path, check, with_optimizer=optimizer is not None)
    state: dict = {"model": {n: torch.empty_like(t) for n, t in full_params(model)}}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model.inner, optimizer, options=_OPTIONS)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException: see checkpoint.load_checkpoint
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} does not fit this role's model: {first}") from None
    params = dict(_gpt_params(model))
    with torch.no_grad():
        for name, tensor in from_hf(list(params), state["model"], AttentionShape.of(model.config)):
            params[name].copy_(tensor)
    if optimizer is not None:
        set_optimizer_state_dict(model.inner, optimizer, state["optimizer"], options=_OPTIONS)
    return meta
