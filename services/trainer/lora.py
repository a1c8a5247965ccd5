"""LoRA adapters on a trained role's model (verl's ``model.lora_rank``), through peft.

peft wraps each target layer in place: its weight becomes ``<layer>.base_layer.weight``
(frozen) beside ``<layer>.lora_A.default.weight`` ``(r, in)`` and
``<layer>.lora_B.default.weight`` ``(out, r)``, both trained. Only the trainer sees those
names: what leaves it (weight sync to rollout, exported folders) is each layer's merged
weight under its Hugging Face name, ``W + (lora_alpha / r) * B @ A``, so rollout engines
(the native one, vLLM) load it like any full fine-tune's.

B starts at zero, so a fresh adapter's merged weights are the base model's: the reference
(always the base model) and rollout agree with the actor before its first update.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import overload

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from meshrl.config.sections import ModelConfig

ADAPTER = "default"  # peft's name for the one adapter a role has
BASE = ".base_layer."
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.")


def add_lora(model: nn.Module, cfg: ModelConfig, seed: int = 0, key: str = "model") -> nn.Module:
    """Adds adapters of ``cfg.lora_rank`` to ``model`` (on the CPU) in place and freezes
    everything else in it; returns ``model``. Nothing happens for rank 0. ``key``: the
    config section the settings come from, for messages (``actor_rollout_ref.model``).

    A is drawn at random from ``seed``: every FSDP rank draws the same A (each shards its
    own copy), and a restarted role the same as before.

    Raises:
        ValueError: see :func:`inject`.
    """
    if cfg.lora_rank == 0:
        return model
    if any(p.device.type not in ("cpu", "meta") for p in model.parameters()):
        raise ValueError("add_lora draws the adapters on the CPU: move the model after it")
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is untouched
        torch.manual_seed(seed)
        inject(model, cfg, key)
    return model


def inject(model: nn.Module, cfg: ModelConfig, key: str) -> None:
    """peft's injection of ``cfg``'s adapters into ``model`` (any device: a model on the
    meta device checks a config at start without loading weights), then the checks.

    Raises:
        ValueError, naming ``{key}.target_modules``: no layer matched; they name the LM head
            (its log-probs come from its weight in chunks: chunked_head.py); or they put an
            adapter on a layer that is not a plain linear layer (an embedding, GPT-2's
            Conv1D), whose merge this module does not do.
    """
    targets = _as_peft_targets(cfg.target_modules)
    if _names_lm_head(targets):
        raise ValueError(
            f"{key}.target_modules={cfg.target_modules!r} puts an adapter on lm_head; "
            "meshrl computes log-probs from the LM head's weight in chunks and trains "
            "adapters on the decoder's layers only: leave lm_head out"
        )
    config = LoraConfig(
        r=cfg.lora_rank,
        # peft annotates lora_alpha as int, but a float works: scaling = lora_alpha / r.
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]
        target_modules=targets,
        exclude_modules=_as_peft_targets(cfg.exclude_modules),
        lora_dropout=0.0,  # as verl: the old log-probs and the update see one function
    )
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"{key}.target_modules={cfg.target_modules!r}: {e}") from None
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and not _plain_linear(layer):
            base = type(layer.get_base_layer()).__name__
            raise ValueError(
                f"{key}.target_modules={cfg.target_modules!r} puts an adapter on {name} "
                f"({base}); meshrl merges adapters of plain linear layers (nn.Linear) only: "
                "leave it out (exclude_modules) or name linear layers"
            )


def _plain_linear(layer: LoraLayer) -> bool:
    """W (out, in) + s * B @ A holds for peft's Linear adapter on an nn.Linear only."""
    return (
        isinstance(layer, LoraLinear)
        and not layer.fan_in_fan_out
        and type(layer.get_base_layer()) is nn.Linear
    )


@overload
def _as_peft_targets(targets: str | list[str]) -> str | list[str]: ...
@overload
def _as_peft_targets(targets: None) -> None: ...
def _as_peft_targets(targets: str | list[str] | None) -> str | list[str] | None:
    """A single layer name (``q_proj``) as the one-name list peft would take for it: peft
    reads any string but "all-linear" as a regular expression over whole module names, so
    "q_proj" alone would match nothing. Other strings are left to peft as expressions."""
    if isinstance(targets, str) and targets != "all-linear" and re.fullmatch(r"\w+", targets):
        return [targets]
    return targets


def _names_lm_head(target_modules: str | list[str]) -> bool:
    """As peft matches: a string is a regular expression over whole module names
    ("all-linear" leaves the output layer out), a list holds name suffixes."""
    if isinstance(target_modules, str):
        return (
            target_modules != "all-linear" and re.fullmatch(target_modules, "lm_head") is not None
        )
    return any(t == "lm_head" or t.endswith(".lm_head") for t in target_modules)


def adapted_layers(model: nn.Module) -> list[str]:
    """Names of the layers that carry adapters, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes with its base weights alone: the reference
    policy, which a LoRA actor serves itself (verl's ref_in_actor) instead of a reference
    server holding a second copy of the base model.

    Raises:
        ValueError: the model has no adapters (its base model is not kept apart).
    """
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ValueError(
            "base-model log-probs need LoRA adapters (model.lora_rank > 0): this actor "
            "trains every weight, so its base model is not kept; use a reference server"
        )
    # peft's switch: each layer's forward returns base_layer(x) alone while it is set. Set
    # directly, not through enable_adapters(), which would also flip the adapters'
    # requires_grad under FSDP2.
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def lora_settings(model: nn.Module) -> dict | None:
    """``{"rank", "alpha", "scaling", "layers"}`` of the model's adapters, or None without
    any: a checkpoint records them, so its export can merge and its loader can tell a
    mismatch (another rank or scale, or adapters on other layers)."""
    for module in model.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.r:
            return {
                "rank": module.r[ADAPTER],
                "alpha": module.lora_alpha[ADAPTER],
                "scaling": module.scaling[ADAPTER],
                "layers": adapted_layers(model),
            }
    return None


def hf_name(name: str) -> str | None:
    """A trainer parameter's name outside the trainer: the wrapped layer's own name for its
    base weight, None for an adapter's factors (they are merged into that weight)."""
    if any(part in name for part in ADAPTER_PARTS):
        return None
    return name.replace(BASE, ".")


def merged_weight(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``base (out, in) + scaling * lora_b (out, r) @ lora_a (r, in)``, in base's dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (base.float() + delta).to(base.dtype)


def named_full_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face names and full shapes, in :func:`iter_merged_params` order."""
    return [
        (name, tuple(p.shape))
        for peft_name, p in model.named_parameters()
        if (name := hf_name(peft_name)) is not None
    ]


def iter_merged_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of every weight, adapters merged, one at a time.

    Each full tensor is a gather over the FSDP ranks (a collective): every rank must
    drain this iterator in step. The model must be resharded (its float32 masters)."""
    for name, param in model.named_parameters():
        out_name = hf_name(name)
        if out_name is None:
            continue
        with torch.no_grad():  # per item: a `with` around the yields would leak into the caller
            full = _full(param)
            if BASE in name and name.endswith(".weight"):
                layer = model.get_submodule(name[: name.index(BASE)])
                assert isinstance(layer, LoraLayer)  # peft's wrapper owns the base_layer
                lora_a, lora_b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
                assert isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor)
                full = merged_weight(full, _full(lora_a), _full(lora_b), layer.scaling[ADAPTER])
        yield out_name, full


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()
