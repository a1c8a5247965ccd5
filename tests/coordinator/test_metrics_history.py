"""A run's latest history from a metrics.jsonl that went back (a recovery, a resume)."""

from services.coordinator.metrics.history import latest_history


def test_later_lines_of_a_step_replace_earlier_ones_and_end_the_history_after_it():
    rows = [
        {"step": 44, "score": 0.44},
        {"step": 45, "score": 0.45},
        {"step": 41, "score": 1.41},  # back to the checkpoint at step 40
        {"step": 42, "score": 1.42},
        {"step": 42, "val": 0.5},  # the step's validation, on a line of its own
    ]
    assert latest_history(rows) == [
        {"step": 41, "score": 1.41},
        {"step": 42, "score": 1.42, "val": 0.5},
    ]


def test_a_history_that_never_went_back_is_kept_as_it_is():
    rows = [{"step": 0, "val": 0.1}, {"step": 1, "score": 0.2}, {"step": 2, "score": 0.3}]
    assert latest_history(rows) == rows


def test_a_step_run_again_leaves_nothing_of_its_abandoned_run():
    rows = [
        {"step": 1, "score": 0.1},
        {"step": 2, "score": 0.2, "val": 0.9},  # validated, then the run went back to step 1
        {"step": 2, "score": 0.3},
    ]
    assert latest_history(rows) == [{"step": 1, "score": 0.1}, {"step": 2, "score": 0.3}]
