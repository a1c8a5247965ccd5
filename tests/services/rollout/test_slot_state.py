"""The per-slot bookkeeping of a decode step: eager, and compiled as it runs on CUDA (here
compiled for the CPU: the same graph, so the same in-place writes)."""

import torch

from services.rollout.fast.slots import SlotState, record_step


def _state() -> SlotState:
    state = SlotState(slots=4, max_tokens=3, slot_len=8, device=torch.device("cpu"))
    # Slots 0-2 hold sequences (prompts of 2, 5 and 6 tokens), slot 3 is free.
    state.admit(
        torch.tensor([0, 1, 2]),
        torch.tensor([2, 5, 6]),
        torch.tensor([10, 11, 12]),
        torch.tensor([-0.1, -0.2, -0.3]),
        torch.tensor([7]),
    )
    return state


def _steps(state: SlotState, fn) -> None:
    # Step 1: slot 1 draws the stop token 7. Step 2: slot 2 reaches the last position.
    for tokens in ([20, 7, 22, 23], [30, 31, 32, 33]):
        t = torch.tensor(tokens)
        args = (
            state.tokens,
            state.logprobs,
            state.gen_len,
            state.done,
            state.stopped,
            state.last_tokens,
            state.positions,
            t,
            -t.float() / 100,
            torch.tensor([7]),
            state.max_tokens,
            state.slot_len - 1,
        )
        fn(*args)


def test_record_step_tracks_lengths_stops_and_positions():
    state = _state()
    _steps(state, record_step)
    assert state.tokens[:3].tolist() == [[10, 20, 30, 0], [11, 7, 31, 0], [12, 22, 32, 0]]
    assert state.gen_len.tolist() == [3, 2, 3, 0]
    assert state.stopped.tolist() == [False, True, False, False]
    assert state.done.tolist() == [True, True, True, True]  # max_tokens 3; slot 3 was free
    assert state.positions.tolist() == [4, 6, 7, 0]  # slot 2 stops at the slot's end
    assert state.last_tokens.tolist() == [30, 31, 32, 33]


def test_compiled_record_step_writes_what_eager_does():
    eager, compiled = _state(), _state()
    _steps(eager, record_step)
    _steps(compiled, torch.compile(record_step, dynamic=True))
    for name in ("tokens", "logprobs", "gen_len", "done", "stopped", "last_tokens", "positions"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
