"""Loading the role models from a local Hugging Face folder (never the hub).

Weights are float32 master weights; a lower compute dtype is a mixed-precision policy
applied when the model is sharded (``fsdp.shard_model(mp_policy=...)``), not a property of
the weights (``model.dtype``; the critic's follows the actor's unless set).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from meshrl.model_files import naming_bad_weights
from services.trainer.chunked_head import install_chunked_head
from services.trainer.value_model import ValueModel
from services.trainer.varlen_attention import VARLEN_ATTENTION

hf_logging.disable_progress_bar()


def load_policy_model(
    path: str,
    device: torch.device | str = "cpu",
    gradient_checkpointing: bool = False,
    remove_padding: bool = False,
) -> PreTrainedModel:
    """The actor's or reference's causal LM, float32, in training mode.

    ``remove_padding`` (``model.use_remove_padding``) gives it the varlen attention that
    padding-free rows need (``varlen_attention.py``); otherwise transformers' default.
    """
    _check_folder(path)
    with naming_bad_weights(path):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True, **_attention(remove_padding)
        )
    _prepare(model, gradient_checkpointing)
    # Log-probs and entropy straight from the LM head, chunk by chunk: the float32 logits
    # of a whole micro-batch are never materialised (see chunked_head.py).
    install_chunked_head(model)
    # PreTrainedModel.to is wrapped with functools.wraps, whose typeshed stub is no
    # descriptor: mypy takes `device` for `self`.
    return model.to(device)  # type: ignore[arg-type]


def load_value_model(
    path: str,
    device: torch.device | str = "cpu",
    gradient_checkpointing: bool = False,
    remove_padding: bool = False,
) -> ValueModel:
    """The critic: the folder's decoder (its LM head is not loaded) + a zero value head."""
    _check_folder(path)
    # The folder's LM head is left out on purpose; silence the load report that flags it.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with naming_bad_weights(path):
            decoder = AutoModel.from_pretrained(
                path, dtype=torch.float32, local_files_only=True, **_attention(remove_padding)
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    _prepare(decoder, gradient_checkpointing)
    return ValueModel(decoder).to(device)


def _attention(remove_padding: bool) -> dict:
    return {"attn_implementation": VARLEN_ATTENTION} if remove_padding else {}


def _check_folder(path: str) -> None:
    if not path or not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a local Hugging Face folder")


def _prepare(model: PreTrainedModel, gradient_checkpointing: bool) -> None:
    model.config.use_cache = False  # training forwards never reuse a KV cache
    if gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's hooks (the reentrant one does not).
        kwargs = {"use_reentrant": False}
        # the name since transformers 5.2x (vLLM's CPU build holds transformers below 5.20)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


class DecoderConfig(Protocol):
    """The fields of a Hugging Face decoder's config that the trainer reads."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int


class _Configured(Protocol):
    config: DecoderConfig


def decoder_config(model: nn.Module) -> DecoderConfig:
    """The config of a causal LM, or of the decoder a :class:`ValueModel` wraps."""
    # nn.Module types a submodule attribute as Tensor | Module: .model is the decoder.
    return getattr(model, "config", None) or cast(_Configured, model.model).config


def freeze(model: nn.Module) -> nn.Module:
    """No gradients and eval mode: the reference policy never changes."""
    model.requires_grad_(False)
    return model.eval()
