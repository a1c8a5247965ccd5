"""The ids that end a response, read from a model's configs and its tokenizer (every engine
stops on all of them: chat models often end a turn with a token only one of them names)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def eos_token_ids(configs: Iterable[object | None], tokenizer_dir: str) -> list[int]:
    """The EOS ids of ``configs`` (a generation config, a model config; None ones skipped)
    and of the tokenizer in ``tokenizer_dir``, if that folder holds one."""
    sources = [c for c in configs if c is not None]
    if any((Path(tokenizer_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        sources.append(AutoTokenizer.from_pretrained(tokenizer_dir))
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)


def folder_eos_token_ids(model_dir: str, tokenizer_dir: str) -> list[int]:
    """:func:`eos_token_ids` of a model folder whose model is not loaded here (vLLM's)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        generation = None  # no generation_config.json
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return eos_token_ids([generation, config], tokenizer_dir)
