"""A character-level tokenizer for arithmetic prompts, built with the `tokenizers` library.

One token per character of ``0-9 + - * = # Q :`` and space, plus pad/bos/eos/unk. It ships a
chat template, so the coordinator's chat-template path is exercised exactly as with a real
model's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=# Q:")
PRINTABLE_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
"""Every printable ASCII character and the newline: enough for tool calls in JSON and the
observations of a multi-turn rollout."""

# Renders the user turns only: the demo's prompts carry their own "Q: ... =" format.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_char_tokenizer(chars: list[str] | None = None) -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (default: the arithmetic ones, ``CHARS``)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + (chars or CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_tokenizer(
    path: str | Path, chars: list[str] | None = None
) -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer(chars)
    tok.save_pretrained(str(path))
    return tok
