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


def make_model_dir(path: str | Path, layers: int = 24, seed: int = 0, dtype=torch.bfloat16) -> str:
    """Writes a random Qwen2.5-0.5B-shaped model (initialised on the GPU, fast) to ``path``."""
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen05_config(layers)).to(dtype)
    model.generation_config = GenerationConfig(pad_token_id=0)
    model.save_pretrained(str(path))
    return str(path)
