"""Random-weight model folders of a real model's shape, for GPU benchmarks (nothing is
downloaded: the H200 reaches no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM


def qwen05_config(layers: int = 24) -> Qwen2Config:
    """Qwen2.5-0.5B's shape (494M parameters at 24 layers); no EOS, so every sampled
    response runs to max_tokens and runs compare like for like."""
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


# Qwen2.5's larger shapes: (hidden, layers, intermediate, heads, kv heads, vocab, tied).
QWEN25_SHAPES = {
    "1.5b": (1536, 28, 8960, 12, 2, 151936, True),
    "3b": (2048, 36, 11008, 16, 2, 151936, True),
    "7b": (3584, 28, 18944, 28, 4, 152064, False),
}


def qwen25_config(shape: str) -> Qwen2Config:
    """Qwen2.5-<shape>'s shape ("0.5b", "1.5b", "3b", "7b"), no EOS as qwen05_config."""
    if shape == "0.5b":
        return qwen05_config()
    hidden, layers, intermediate, heads, kv, vocab, tied = QWEN25_SHAPES[shape]
    config = qwen05_config(layers)
    config.update(
        dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            tie_word_embeddings=tied,
        )
    )
    return config


def make_model_dir(
    path: str | Path, layers: int = 24, seed: int = 0, dtype=torch.bfloat16, shape: str = "0.5b"
) -> str:
    """Writes a random Qwen2.5-shaped model (0.5B unless ``shape`` says otherwise; on the GPU
    where there is one, fast) to ``path``."""
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        config = qwen05_config(layers) if shape == "0.5b" else qwen25_config(shape)
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(pad_token_id=0)
    model.save_pretrained(str(path))
    return str(path)
