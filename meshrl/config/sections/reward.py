"""``reward``: rule scorers or a custom function, a reward model, DAPO's overlong penalty."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.sections.base import PathText, Section


class RewardModelConfig(Section):
    enable: bool = False
    """Score with a model besides (or instead of) the rule scorers."""
    path: PathText = ""
    """Hugging Face sequence- or token-classification model folder, or a hub id (fetched as
    model.path's)."""
    micro_batch_size: int = Field(16, gt=0)
    """(prompt, response) pairs per reward-model forward."""
    max_length: int = Field(2048, gt=0)
    """Tokens of a rendered (prompt, response) pair at most, in the reward model's tokenizer;
    longer pairs are cut from the left (the head reads the end)."""
    weight: float = 1.0
    """Weight of the model score when combined with a rule score."""


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment: a penalty growing linearly to ``-penalty_factor``
    over the last ``len`` tokens of ``data.max_response_length``, added to the score."""

    enable: bool = False
    """Add the penalty to the training scores."""
    len: int = Field(4096, gt=0)
    """Tokens before the response limit over which the penalty grows (verl's default);
    at most data.max_response_length."""
    penalty_factor: float = Field(1.0, ge=0)
    """The penalty at the limit."""
    log: bool = False
    """Accepted for verl's configs: the penalty's metrics are always logged."""


class RewardConfig(Section):
    custom_function: PathText | None = None
    """`path/to/file.py:function_name` scoring (data_source, response, ground_truth, extra_info)."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-sample scorer limit."""
    num_workers: int = Field(2, ge=1)
    """Scorer worker processes."""
    gsm8k_method: Literal["strict", "flexible", "lenient"] = "strict"
    """How the GSM8k rule scorer reads the answer: strict, verl's (`#### N` with one space,
    in the response's last 300 characters); flexible, verl's (the last number there); lenient,
    meshrl's own (the last `####` anywhere, spaces, a newline or `$` before the number and a
    final period allowed)."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """A Hugging Face reward model, run in the reward server (docs/reward.md)."""
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """Applied by the coordinator to training scores (validation reports them unshaped)."""
