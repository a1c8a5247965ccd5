"""Builds tiny causal LM folders (config, safetensors, tokenizer) from a config.

Used by tests, the demo and the benchmarks' dry runs; nothing is downloaded. The Llama of
hidden 64, 2 layers, 2 heads is about 84k parameters on the 22-symbol character
vocabulary; the Qwen2 has grouped-query attention (4 query heads over 2 KV heads), as
Qwen2.5 has.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from meshrl.testing.char_tokenizer import save_char_tokenizer


def tiny_llama_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 256,
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def make_tiny_model_dir(
    path: str | Path, seed: int = 0, chars: list[str] | None = None, **config_kwargs
) -> Path:
    """Writes a random-init tiny Llama + the char tokenizer (of ``chars``; default the
    arithmetic ones) to `path`; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = save_char_tokenizer(path, chars)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(len(tok), **config_kwargs))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(str(path))
    return path


def make_tiny_reward_model_dir(path: str | Path, seed: int = 0) -> Path:
    """Writes a random-init tiny Llama reward model (a sequence-classification head of one
    label) with the char tokenizer to ``path``; returns the path."""
    path = Path(path)
    tok = save_char_tokenizer(path)
    config = tiny_llama_config(len(tok), hidden=32, layers=2, heads=2, intermediate=64)
    config.num_labels = 1
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(str(path))
    return path


def tiny_qwen2_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    intermediate: int = 128,
    max_positions: int = 256,
    tie_word_embeddings: bool = True,
) -> Qwen2Config:
    """4 query heads over 2 KV heads; special ids as the char tokenizer's."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def make_tiny_qwen2_dir(
    path: str | Path, seed: int = 1, tokenizer: bool = True, **config_kwargs
) -> Path:
    """Writes a random-init tiny Qwen2 (+ the char tokenizer unless ``tokenizer=False``, then
    ``vocab_size`` must be given) to ``path``; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        config_kwargs.setdefault("vocab_size", len(save_char_tokenizer(path)))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**config_kwargs))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(path))
    return path
