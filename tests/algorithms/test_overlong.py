"""DAPO's soft overlong punishment, against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms import overlong_penalty


def test_zero_until_the_buffer_then_linear_to_the_factor():
    # L_max 20, buffer 4: free up to 16 tokens; 17 -> -1/4 of the factor, 20 -> all of it
    lengths = torch.tensor([0, 10, 16, 17, 18, 20])
    out = overlong_penalty(lengths, 20, 4, 0.5)
    assert out.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5]
    assert out.dtype == torch.float32


def test_a_buffer_of_the_whole_budget_penalises_from_the_first_token():
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10, 1.0).tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("buffer_len", [0, -1, 21])
def test_a_buffer_outside_the_budget_is_refused(buffer_len):
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(torch.tensor([3]), 20, buffer_len, 1.0)


def test_a_one_token_buffer_is_allowed():
    # buffer_len = 1: no penalty up to L_max - 1 tokens, the full factor at L_max.
    out = overlong_penalty(
        torch.tensor([3, 4]), max_response_length=4, buffer_len=1, penalty_factor=1.0
    )
    torch.testing.assert_close(out, torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([3]), max_response_length=4, buffer_len=0, penalty_factor=1.0)
