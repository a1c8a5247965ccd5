import pytest
import torch

from meshrl.ragged import Ragged
from services.trainer.sequences import (
    at_response_positions,
    pack_sequences,
    ragged_to_padded,
)
from services.trainer.types import SequenceBatch


def _batch() -> SequenceBatch:
    # The middle row is the longest, so both padding shapes occur: the first row is
    # padded after its response, the last after a short prompt + response.
    prompts = Ragged.from_lists([[1, 5], [1, 6, 7, 8], [1]])
    responses = Ragged.from_lists([[10, 11, 12], [13, 14], [15]])
    return SequenceBatch(prompts, responses)


def test_rows_are_prompt_then_response_right_padded():
    packed = pack_sequences(_batch(), pad_id=0)
    assert packed.input_ids.tolist() == [
        [1, 5, 10, 11, 12, 0],
        [1, 6, 7, 8, 13, 14],
        [1, 15, 0, 0, 0, 0],
    ]
    assert packed.attention_mask.tolist() == [[1] * 5 + [0], [1] * 6, [1, 1, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [list(range(6))] * 3
    assert packed.response_ids.tolist() == [[10, 11, 12], [13, 14, 0], [15, 0, 0]]
    assert packed.response_mask.tolist() == [[True] * 3, [True, True, False], [True, False, False]]


def test_predictor_is_the_position_before_each_response_token():
    packed = pack_sequences(_batch())
    # Row 0: prompt of 2 -> response tokens at 2, 3, 4 are predicted at 1, 2, 3.
    # Row 1: prompt of 4 -> positions 3, 4. Row 2: prompt of 1 -> position 0.
    assert packed.predictor_index.tolist() == [[1, 2, 3], [3, 4, 0], [0, 0, 0]]
    assert packed.first_predictor == 0  # the shortest prompt has 1 token
    assert packed.outputs_needed == 6


def test_at_response_positions_reads_the_predicting_outputs():
    packed = pack_sequences(_batch())
    # Output at position p is 100 * row + p: easy to read back.
    outputs = 100 * torch.arange(3).unsqueeze(1) + torch.arange(6).unsqueeze(0)  # (3, 6)
    picked = at_response_positions(outputs, packed)
    mask = packed.response_mask
    assert picked[mask].tolist() == [1, 2, 3, 103, 104, 200]


def test_at_response_positions_with_only_the_trailing_outputs():
    batch = SequenceBatch(
        Ragged.from_lists([[1, 2, 3], [1, 2, 3, 4]]), Ragged.from_lists([[5], [6, 7]])
    )
    packed = pack_sequences(batch)
    assert packed.first_predictor == 2 and packed.outputs_needed == 4  # t = 6
    full = torch.arange(6).repeat(2, 1)  # (2, 6): output value = its position
    tail = full[:, 2:]  # what logits_to_keep=4 returns
    mask = packed.response_mask
    from_tail = at_response_positions(tail, packed)[mask]
    assert torch.equal(from_tail, at_response_positions(full, packed)[mask])
    assert from_tail.tolist() == [2, 3, 4]


def test_response_width_and_round_trip_to_flat_values():
    batch = _batch()
    packed = pack_sequences(batch, response_width=5)
    assert packed.response_ids.shape == (3, 5)
    values = torch.arange(15, dtype=torch.float32).reshape(3, 5)  # (b, r)
    flat = Ragged.from_padded(values, batch.response_lengths)  # back to flat values
    assert flat.values.tolist() == [0, 1, 2, 5, 6, 10]
    assert torch.equal(flat.offsets, batch.responses.offsets)
    back = ragged_to_padded(flat, 5)
    assert torch.equal(back[packed.response_mask], values[packed.response_mask])
    assert back[~packed.response_mask].abs().sum() == 0


def test_empty_response_row_has_no_mask():
    batch = SequenceBatch(Ragged.from_lists([[1, 2], [3]]), Ragged.from_lists([[], [4, 5]]))
    packed = pack_sequences(batch)
    assert packed.response_mask.tolist() == [[False, False], [True, True]]
    assert packed.input_ids.tolist() == [[1, 2, 0], [3, 4, 5]]


def test_invalid_batches():
    with pytest.raises(ValueError, match="each prompt needs exactly one response"):
        SequenceBatch(Ragged.from_lists([[1]]), Ragged.from_lists([[2], [3]]))
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences(SequenceBatch(Ragged.from_lists([[]]), Ragged.from_lists([[2]])))


def test_select_keeps_pairs_together():
    batch = _batch().select(torch.tensor([2, 0]))
    assert batch.prompts.tolist() == [[1], [1, 5]]
    assert batch.responses.tolist() == [[15], [10, 11, 12]]
