"""``data``: the prompts, their files, lengths, batch sizes and order."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.sections.base import FileList, PathText, Section


class DataConfig(Section):
    train_files: FileList[PathText] = Field(default_factory=list)
    """Parquet files of training prompts in verl's schema (one path alone is a list of one;
    null is none)."""
    val_files: FileList[PathText] = Field(default_factory=list)
    """Parquet files of validation prompts (one path alone is a list of one); empty or null
    disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a chat message list or a plain string."""
    max_prompt_length: int = Field(512, gt=0)
    """Prompt tokens at most (after the chat template)."""
    max_response_length: int = Field(512, gt=0)
    """New tokens per response at most."""
    train_batch_size: int = Field(256, gt=0)
    """Prompts per PPO step."""
    gen_batch_size: int | None = Field(None, gt=0)
    """Prompts per generation batch with dynamic sampling (verl's DAPO key): a step
    generates batches of this many prompts until `train_batch_size` with varied groups are
    kept. None = `train_batch_size`. Without `algorithm.filter_groups.enable` it must equal
    `train_batch_size` (verl would then train on the whole generation batch)."""
    val_batch_size: int | None = Field(None, gt=0)
    """Prompts per validation generate call; None = the whole validation set at once."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (seeded by `data.seed`)."""
    seed: int = 1
    """Seed of the data order."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` when the dataset is loaded."""
    truncation: Literal["error", "left", "right"] = "error"
    """What to do with a prompt still over the limit: fail, or keep its last/first tokens."""
    apply_chat_template: bool = True
    """Render `prompt` with the tokenizer's chat template (a plain string is sent as one user turn)."""
    max_samples: int = -1
    """Use at most this many training rows, the first of `train_files` (-1 = all)."""
    val_max_samples: int = -1
    """Use at most this many validation rows, the first of `val_files` (-1 = all; verl's
    key of the same name)."""
    unscorable_rows: Literal["error", "skip"] = "error"
    """Rows the run's reward cannot score: rows of a data_source the rule scorers score
    (no `reward.custom_function`, no reward model) whose `reward_model` is null or has no
    `ground_truth`, so that every response would score 0. error: the run is refused before
    any role server starts, naming the file, the row and the column; skip: they are left
    out of the data set, counted in a warning."""
