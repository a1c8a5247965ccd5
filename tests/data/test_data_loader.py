"""PromptLoader: seeded per-epoch order, epochs rolling over, exact resume."""

import pytest
import torch

from meshrl.data.loader import PromptLoader

pytestmark = pytest.mark.timeout(30)

DATA = list(range(10))  # any sequence works; records are just served back


def test_steps_per_epoch_and_drop_last():
    assert PromptLoader(DATA, 3).steps_per_epoch == 3
    assert PromptLoader(DATA, 3, drop_last=False).steps_per_epoch == 4
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(DATA, 11)


def test_epoch_order_is_seeded_permutation():
    loader = PromptLoader(DATA, 5, seed=7)
    first = [loader.next_batch() for _ in range(2)]
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    assert [e for e, _ in first] == [0, 0]
    assert first[0][1] + first[1][1] == expected
    epoch, batch = loader.next_batch()
    second = torch.randperm(10, generator=torch.Generator().manual_seed(8)).tolist()
    assert epoch == 1 and batch == second[:5]


def test_no_shuffle_and_last_partial_batch():
    loader = PromptLoader(DATA, 4, shuffle=False, drop_last=False)
    assert [loader.next_batch()[1] for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert loader.next_batch() == (1, [0, 1, 2, 3])


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_resume_gives_the_same_following_batches(k):
    straight = PromptLoader(DATA, 3, seed=11)
    expected = [straight.next_batch() for _ in range(12)]

    first = PromptLoader(DATA, 3, seed=11)
    for _ in range(k):
        first.next_batch()
    state = first.state_dict()
    resumed = PromptLoader(DATA, 3, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(12 - k)] == expected[k:]


def test_state_dict_keys_and_bad_position():
    loader = PromptLoader(DATA, 5)
    loader.next_batch()
    assert loader.state_dict() == {
        "epoch": 0,
        "batch_in_epoch": 1,
        "seed": 1,
        "prompts": len(DATA),
        "batch_size": 5,
    }
    with pytest.raises(ValueError, match="batch_in_epoch=7"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 7, "seed": 1})


def test_resume_over_other_prompts_is_a_warning_naming_both(caplog):
    state = PromptLoader(DATA, 5).state_dict()
    with caplog.at_level("WARNING", logger="meshrl.data.loader"):
        PromptLoader(DATA, 5).load_state_dict(state)
        assert not caplog.records  # the same data: nothing to say
        PromptLoader(DATA[:-5], 5).load_state_dict(state)
    (record,) = caplog.records
    assert f"over {len(DATA) - 5} prompts in batches of 5" in record.getMessage()
    assert f"saved over {len(DATA)} prompts in batches of 5" in record.getMessage()
