"""Collecting finished sequences a round late (``harvest.py``), on CPU: which slots a check
reports, that outputs gathered before a refill survive it, and the flush by size."""

import torch

from services.rollout.fast.harvest import Harvest, HarvestRings
from services.rollout.fast.slots import SlotState

STOP = torch.tensor([7])


def _running() -> tuple[SlotState, list[int]]:
    """Slots 0-2 hold sequences 5, 3 and 8 (slot 3 is free); one step: slot 1 stops."""
    state = SlotState(slots=4, max_tokens=4, slot_len=16, device=torch.device("cpu"))
    state.admit(
        torch.tensor([0, 1, 2]),
        torch.tensor([2, 3, 4]),
        torch.tensor([10, 11, 12]),
        torch.tensor([-0.1, -0.2, -0.3]),
        STOP,
    )
    state.record(torch.tensor([20, 7, 22]), torch.tensor([-1.0, -2.0, -3.0]), STOP)
    return state, [5, 3, 8, -1]


def test_a_check_reports_each_finished_sequence_once():
    state, slot_seq = _running()
    harvest = Harvest(total=9, rings=HarvestRings(4, torch.device("cpu")))
    check = harvest.queue_check(state.done, slot_seq)
    # The next round runs before the check is read: slot 1 (done) steps on, unseen.
    state.record(torch.tensor([30, 31, 32]), torch.tensor([-1.0, -1.0, -1.0]), STOP)
    later = harvest.queue_check(state.done, slot_seq)
    assert check.finished(slot_seq) == [(1, 3)]
    harvest.take([(1, 3)], state)
    slot_seq[1] = -1  # released
    # The later check sees slot 1 done again: already taken, so not reported twice.
    assert later.finished(slot_seq) == []
    tokens, logprobs, reasons = harvest.result()
    assert tokens.row(3).tolist() == [11, 7] and reasons[3] == "stop"
    assert torch.equal(logprobs.row(3), torch.tensor([-0.2, -2.0]))
    assert tokens.row(5).numel() == 0 and reasons[5] == "length"  # still running: not filed
    assert len(tokens) == len(logprobs) == len(reasons) == 9


def test_outputs_gathered_before_a_refill_survive_it():
    state, slot_seq = _running()
    harvest = Harvest(total=9, rings=HarvestRings(4, torch.device("cpu")))
    harvest.take([(1, 3)], state)
    # Slot 1 is refilled by sequence 6 before the host copies anything.
    state.admit(
        torch.tensor([1]), torch.tensor([2]), torch.tensor([40]), torch.tensor([-4.0]), STOP
    )
    slot_seq[1] = 6
    check = harvest.queue_check(state.done, slot_seq)
    assert check.finished(slot_seq) == []  # the new sequence is running
    tokens, _, _ = harvest.result()
    assert tokens.row(3).tolist() == [11, 7]


def test_length_ends_and_flush_by_size():
    state, slot_seq = _running()
    for _ in range(2):  # slots 0 and 2 reach max_tokens = 4
        state.record(torch.tensor([50, 51, 52]), torch.tensor([-5.0, -5.0, -5.0]), STOP)
    harvest = Harvest(total=9, rings=HarvestRings(4, torch.device("cpu")), flush_bytes=1)
    finished = harvest.queue_check(state.done, slot_seq).finished(slot_seq)
    assert finished == [(0, 5), (1, 3), (2, 8)]
    harvest.take(finished, state)  # over flush_bytes: copied to the host at once
    assert not harvest._parts
    tokens, logprobs, reasons = harvest.result()
    assert tokens.row(5).tolist() == [10, 20, 50, 50] and reasons[5] == "length"
    assert tokens.row(8).tolist() == [12, 22, 52, 52]
    assert torch.equal(logprobs.row(8), torch.tensor([-0.3, -3.0, -5.0, -5.0]))
    assert reasons[3] == "stop"


def test_parts_gathered_in_several_rounds_come_back_in_sequence_order():
    state, slot_seq = _running()
    harvest = Harvest(total=9, rings=HarvestRings(4, torch.device("cpu")))
    harvest.take([(1, 3)], state)
    harvest.flush()  # one part on the host, the next still on the device
    for _ in range(2):
        state.record(torch.tensor([50, 51, 52]), torch.tensor([-5.0, -5.0, -5.0]), STOP)
    harvest.take([(2, 8), (0, 5)], state)
    tokens, logprobs, reasons = harvest.result()
    assert tokens.tolist() == [[], [], [], [11, 7], [], [10, 20, 50, 50], [], [], [12, 22, 52, 52]]
    assert logprobs.lengths.tolist() == tokens.lengths.tolist()
    assert tokens.values.dtype == torch.int64 and logprobs.values.dtype == torch.float32
    assert reasons == ["length"] * 3 + ["stop"] + ["length"] * 5
