"""The run's tokenizer as the environment server uses it: observation text -> token ids."""

from __future__ import annotations

from collections.abc import Callable


def load_encoder(path: str) -> Callable[[str], list[int]]:
    """``text -> ids`` with the tokenizer at ``path``, no special tokens added: the ids are
    appended to a sequence as they are. ValueError when no tokenizer loads from it."""
    if not path:
        raise ValueError(
            "actor_rollout_ref.model.path is empty: the env server needs its tokenizer"
        )
    from transformers import AutoTokenizer  # heavy: only at Initialize

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no tokenizer could be loaded from {path!r}: {e}") from None
    return lambda text: list(tok.encode(text, add_special_tokens=False))
