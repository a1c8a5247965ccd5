import pytest
import torch

from meshrl.ragged import Ragged
from meshrl.wire import ragged_from_proto, ragged_to_proto, tensor_from_proto, tensor_to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_tensor_round_trip(dtype):
    t = (torch.randn(3, 4) * 100).to(dtype)
    back = tensor_from_proto(tensor_to_proto(t))
    assert back.dtype == dtype and back.shape == (3, 4)
    assert torch.equal(back, t)


def test_tensor_bytes_must_match_shape():
    msg = tensor_to_proto(torch.zeros(4))
    msg.shape[:] = [5]
    with pytest.raises(ValueError, match="needs 5"):
        tensor_from_proto(msg)


def test_ragged_round_trip_and_padding():
    r = Ragged.from_lists([[1, 2, 3], [], [4]])
    back = ragged_from_proto(ragged_to_proto(r))
    assert back.tolist() == [[1, 2, 3], [], [4]]
    padded, mask = back.to_padded(pad_value=-1)
    # row 1 is empty, row 2 has one token: padding sits in the middle of the batch
    assert padded.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert mask.sum().item() == 4
    assert Ragged.from_padded(padded, back.lengths).tolist() == [[1, 2, 3], [], [4]]


def test_ragged_rejects_bad_offsets():
    with pytest.raises(ValueError, match="offsets end"):
        Ragged(torch.zeros(3), torch.tensor([0, 2]))
