"""DAPO's soft overlong punishment: a linear penalty over the last ``buffer_len`` tokens of
the response budget, so a response that nears the limit loses reward before it is cut.

``penalty_i = min(0, -(L_i - (L_max - buffer_len)) / buffer_len * factor)``

0 up to ``L_max - buffer_len`` tokens, ``-factor`` at ``L_max``. Yu et al. 2025 (DAPO, §3.4);
verl ``recipe/dapo`` reward manager (``overlong_buffer``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """The penalty to add to each sequence's score.

    Args:
        lengths: ``(b,)`` response lengths in tokens.
        max_response_length: the response budget ``L_max``.
        buffer_len: tokens before ``L_max`` over which the penalty grows, 0 < it <= ``L_max``.
        penalty_factor: the penalty at ``L_max``.

    Returns:
        ``(b,)`` float32, each in ``[-penalty_factor * L_i-overshoot, 0]``: 0 up to
        ``L_max - buffer_len`` tokens, then linear.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"buffer_len must be in (0, {max_response_length}], got {buffer_len}")
    expected = max_response_length - buffer_len
    exceed = lengths.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
