import pytest
import torch

from services.trainer.micro_batches import epoch_seed, plan_epoch

LENGTHS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5])  # 9 rows, 36 tokens


def _rows(plan, micro_only_real=True):
    return [
        r
        for mini in plan
        for micro in mini.micro_batches
        if micro.weight or not micro_only_real
        for r in micro.rows.tolist()
    ]


def test_single_rank_mini_and_micro_batches():
    plan = plan_epoch(LENGTHS, mini_batch_rows=4, micro_batch_rows=3)
    assert [m.rows.tolist() for m in plan] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    # Global counts are the mini-batch's: 3+1+4+1 = 9 tokens, 4 sequences.
    assert [(m.token_count, m.seq_count) for m in plan] == [(9, 4), (22, 4), (5, 1)]
    assert [[mb.rows.tolist() for mb in m.micro_batches] for m in plan[:2]] == [
        [[0, 1], [2, 3]],  # 4 rows in ceil(4/3) = 2 parts, none over 3
        [[4, 5], [6, 7]],
    ]
    assert _rows(plan) == list(range(9))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_share_every_row_once_with_equal_micro_counts(world_size):
    plans = [plan_epoch(LENGTHS, 4, 1, rank=r, world_size=world_size) for r in range(world_size)]
    all_rows = sorted(r for plan in plans for r in _rows(plan))
    assert all_rows == list(range(9))
    for i in range(len(plans[0])):
        counts = {len(plan[i].micro_batches) for plan in plans}
        assert len(counts) == 1, "every rank must run the same number of forward/backward"
        # Global counts do not depend on the rank.
        assert len({(plan[i].token_count, plan[i].seq_count) for plan in plans}) == 1


def test_a_rank_without_rows_gets_a_zero_weight_micro_batch():
    # The last mini-batch has one row: rank 0 takes it, rank 1 pads.
    rank0 = plan_epoch(LENGTHS, 4, 2, rank=0, world_size=2)[-1]
    rank1 = plan_epoch(LENGTHS, 4, 2, rank=1, world_size=2)[-1]
    assert [(m.rows.tolist(), m.weight) for m in rank0.micro_batches] == [([8], 1.0)]
    assert [(m.rows.tolist(), m.weight) for m in rank1.micro_batches] == [([8], 0.0)]


def test_shuffle_is_seeded_and_a_permutation():
    a = plan_epoch(LENGTHS, 4, 4, shuffle=True, seed=epoch_seed(1, 5, 0))
    b = plan_epoch(LENGTHS, 4, 4, shuffle=True, seed=epoch_seed(1, 5, 0))
    c = plan_epoch(LENGTHS, 4, 4, shuffle=True, seed=epoch_seed(1, 5, 1))
    rows = lambda plan: [m.rows.tolist() for m in plan]  # noqa: E731
    assert rows(a) == rows(b)
    assert rows(a) != rows(c)
    assert sorted(_rows(a)) == list(range(9))
    assert a[0].token_count == int(LENGTHS[a[0].rows].sum())


@pytest.mark.parametrize("max_tokens", [None, 20])
def test_a_row_without_response_tokens_is_not_counted_as_a_sequence(max_tokens):
    """N_seq of the seq-mean-* losses: rows with a response token (verl 0.9.1's agg_loss);
    the row still goes through a micro-batch, where its mask adds nothing."""
    lengths = torch.tensor([3, 0, 4, 0, 5])
    (only,) = plan_epoch(
        lengths, 5, 5, max_tokens=max_tokens, sequence_lengths=lengths + 2 if max_tokens else None
    )
    assert (only.seq_count, only.token_count) == (3, 12)
    assert sorted(_rows([only])) == [0, 1, 2, 3, 4]


def test_mini_batch_larger_than_the_batch():
    (only,) = plan_epoch(LENGTHS, 100, 4)
    assert only.seq_count == 9 and only.token_count == 36
    assert len(only.micro_batches) == 3


def test_bad_sizes():
    with pytest.raises(ValueError):
        plan_epoch(torch.tensor([], dtype=torch.int64), 2, 1)
    with pytest.raises(ValueError):
        plan_epoch(LENGTHS, 0, 1)
