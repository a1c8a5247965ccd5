"""The last line of `meshrl run` names where the run ended and only what its folder holds."""

from __future__ import annotations

from meshrl_app.run_local import RunResult
from meshrl_app.run_summary import ended_line


def test_a_console_only_run_without_checkpoints_names_no_file(tmp_path):
    """Before: `(metrics.jsonl, checkpoints/)` with trainer.logger=console, which writes
    neither."""
    result = RunResult({}, finished=True, step=3, total_steps=3)
    assert ended_line(result, tmp_path) == (
        f"meshrl: run finished at step 3 of 3; run folder {tmp_path} "
        "(no metrics.jsonl, no checkpoint)"
    )


def test_the_files_there_and_the_newest_checkpoint_are_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    for step in (2, 10, 4):
        (tmp_path / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-global_step_12").mkdir()  # a save that did not finish
    result = RunResult({}, finished=False, step=10, total_steps=20)
    assert ended_line(result, tmp_path) == (
        f"meshrl: run stopped at step 10 of 20; run folder {tmp_path} "
        "(metrics.jsonl, checkpoints/global_step_10)"
    )


def test_a_run_that_trained_nothing_says_why_once(tmp_path):
    (tmp_path / "checkpoints" / "global_step_2").mkdir(parents=True)
    note = "nothing to train: the run's checkpoint is at step 2, and the run has 2 steps"
    result = RunResult({}, finished=True, note=note, step=2, total_steps=2)
    assert ended_line(result, tmp_path) == (
        f"meshrl: {note}; run folder {tmp_path} (checkpoints/global_step_2)"
    )
    stopped = RunResult({}, finished=False, note="stopped before the first step")
    assert ended_line(stopped, tmp_path).startswith("meshrl: run stopped before the first step;")
