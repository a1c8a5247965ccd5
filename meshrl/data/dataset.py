"""Prompts of verl-schema parquet files, rendered and tokenized once, at load.

Rendering (see docs/data.md):

- ``apply_chat_template=True``: the prompt's messages (a plain string becomes one user
  message) go through the tokenizer's chat template with ``add_generation_prompt=True``; the
  text is then tokenized with ``add_special_tokens=False``, since the template already wrote
  any BOS (as verl does).
- ``apply_chat_template=False`` (base models): the plain text (a string prompt as it is, or the
  messages' contents joined by a blank line) is tokenized with ``add_special_tokens=True``,
  so the model gets the BOS it was pre-trained with where its tokenizer adds one.

Prompts longer than ``max_prompt_length`` tokens are dropped at load when
``filter_overlong_prompts`` (counted and logged); any still over the limit are then handled by
``truncation``: "error" fails naming the row, "left" keeps the last tokens, "right" the first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from meshrl.data.errors import DataError
from meshrl.data.rows import RawRow, read_rows

log = logging.getLogger(__name__)

Truncation = Literal["error", "left", "right"]


@dataclass
class PromptRecord:
    """One prompt, ready for generation and scoring."""

    index: int
    """Row position across the dataset's files, before filtering (0-based, file order)."""
    prompt_ids: list[int]
    """Prompt token ids, chat template applied; at most max_prompt_length."""
    prompt_text: str
    """The rendered prompt text the ids came from."""
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    ability: str = ""
    chat: str = ""
    """The prompt as the row has it, for a reward model to render with its own chat
    template: the message list as JSON, or the plain string ("": unknown)."""
    where: str = ""
    """The row's file and position in it (``train.parquet row 3``)."""
    no_truth: str = ""
    """Why the row has no ground truth (``column reward_model is null``); "" when it has one."""


class PromptDataset:
    """verl's RLHFDataset, eager: every prompt is rendered and tokenized when constructed."""

    def __init__(
        self,
        files: Sequence[str | Path],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: Truncation = "error",
        apply_chat_template: bool = True,
        max_samples: int = -1,
        max_samples_key: str = "data.max_samples",
    ):
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"truncation must be error, left or right, got {truncation!r}")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                "set data.apply_chat_template=false for a base model, or use a chat model"
            )
        if max_samples == 0:  # else "all 0 prompts are longer than max_prompt_length"
            raise DataError(f"{max_samples_key}=0 keeps no prompts; -1 keeps them all")
        self.max_prompt_length = max_prompt_length
        rows = read_rows(list(files), prompt_key)
        if max_samples >= 0:
            rows = rows[:max_samples]
        texts = [render_prompt(r.prompt, tokenizer, apply_chat_template) for r in rows]
        ids = tokenize(texts, tokenizer, add_special_tokens=not apply_chat_template)
        _check_not_empty(rows, ids)
        self.num_dropped = 0
        if filter_overlong_prompts:
            rows, texts, ids = self._filter(rows, texts, ids)
        ids = [self._truncate(r, x, truncation) for r, x in zip(rows, ids, strict=True)]
        self.records = [_record(r, t, x) for r, t, x in zip(rows, texts, ids, strict=True)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def _filter(self, rows: list[RawRow], texts: list[str], ids: list[list[int]]):
        keep = [i for i, x in enumerate(ids) if len(x) <= self.max_prompt_length]
        self.num_dropped = len(rows) - len(keep)
        if not keep:
            raise DataError(
                f"all {len(rows)} prompts are longer than max_prompt_length="
                f"{self.max_prompt_length} tokens and were dropped; raise data.max_prompt_length"
            )
        if self.num_dropped:
            log.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_dropped,
                len(rows),
                self.max_prompt_length,
            )
        return [rows[i] for i in keep], [texts[i] for i in keep], [ids[i] for i in keep]

    def _truncate(self, row: RawRow, ids: list[int], truncation: Truncation) -> list[int]:
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if truncation == "error":
            raise DataError(
                f"{row.where}: prompt is {len(ids)} tokens, over max_prompt_length={limit}; "
                "set data.filter_overlong_prompts=true or data.truncation=left|right"
            )
        return ids[-limit:] if truncation == "left" else ids[:limit]


def _check_not_empty(rows: list[RawRow], ids: list[list[int]]) -> None:
    # No tokens give the policy nothing to continue (an empty prompt, without a chat template,
    # with a tokenizer that adds no BOS): the rollout would refuse it only when its batch comes
    # up, mid-run, naming a batch position instead of the row.
    for row, x in zip(rows, ids, strict=True):
        if not x:
            raise DataError(
                f"{row.where}: the prompt {row.prompt!r:.80} is no tokens once rendered; "
                "fix or remove the row (or set data.apply_chat_template=true for a chat model)"
            )


def render_prompt(prompt: list[dict[str, str]] | str, tokenizer, apply_chat_template: bool) -> str:
    """The prompt as the text the policy reads."""
    if not apply_chat_template:
        if isinstance(prompt, str):
            return prompt
        return "\n\n".join(m["content"] for m in prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def tokenize(texts: list[str], tokenizer, *, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, without truncation (lengths are checked afterwards)."""
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=add_special_tokens, truncation=False)
    return [list(x) for x in out["input_ids"]]


def _record(row: RawRow, text: str, ids: list[int]) -> PromptRecord:
    return PromptRecord(
        index=row.index,
        prompt_ids=ids,
        prompt_text=text,
        data_source=row.data_source,
        ground_truth=row.ground_truth,
        extra_info=row.extra_info,
        ability=row.ability,
        chat=row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt),
        where=row.where,
        no_truth=row.no_truth,
    )
