"""An ``optim`` section (the actor's, the critic's): AdamW and its learning-rate schedule."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from meshrl.config.sections.base import Section


def _verl_warmup_steps(value: object) -> object:
    # verl's -1 (its default): take the warm-up from lr_warmup_steps_ratio, whose only value
    # accepted here is 0 (verl_keys.py): no warm-up
    return 0 if value == -1 and type(value) is int else value


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay (AdamW)."""
    lr_warmup_steps: Annotated[int, BeforeValidator(_verl_warmup_steps)] = Field(0, ge=0)
    """Linear warm-up optimizer steps (counted in PPO steps, as verl does)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    total_training_steps: int | None = None
    """Steps the schedule spans; None = the run's total steps."""
