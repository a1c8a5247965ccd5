"""Generations written out per step (verl's trainer.rollout_data_dir / validation_data_dir)."""

from __future__ import annotations

import json

import pytest

from services.coordinator.generations import generations_dir, write_generations


def item(prompt: str, response: str, ground_truth: str) -> dict:
    """A sample as RolloutBatch.reward_items gives it."""
    return {"prompt": prompt, "response": response, "ground_truth": ground_truth}


def test_a_step_file_holds_one_line_a_sample_with_text_truth_score_and_extras(tmp_path):
    path = write_generations(
        tmp_path / "rollouts",
        7,
        [item("1+2=", "3 #### 3", "3"), item("3+4=", "8", "7")],
        [1.0, 0.0],
        [{"acc": 1.0, "rule_score": 1.0}, {"acc": 0.0, "odd": float("nan")}],
    )
    assert path == tmp_path / "rollouts" / "7.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"input": "1+2=", "output": "3 #### 3", "gts": "3", "score": 1.0, "step": 7,
         "acc": 1.0, "rule_score": 1.0},
        {"input": "3+4=", "output": "8", "gts": "7", "score": 0.0, "step": 7, "acc": 0.0},
    ]  # fmt: skip
    assert [p.name for p in path.parent.iterdir()] == ["7.jsonl"]  # no temporary file left


def test_the_folder_is_off_by_default_and_relative_to_the_run_folder(tmp_path):
    assert generations_dir(None, tmp_path) is None and generations_dir("", tmp_path) is None
    assert generations_dir("rollouts", tmp_path) == tmp_path / "rollouts"
    assert generations_dir(str(tmp_path / "abs"), tmp_path / "run") == tmp_path / "abs"


def test_text_in_any_script_is_written_as_utf8_and_a_failed_write_leaves_no_file(tmp_path):
    path = write_generations(tmp_path, 1, [item("问题 ½", "答案 é", "42")], [1.0], [{}])
    assert json.loads(path.read_text(encoding="utf-8"))["input"] == "问题 ½"
    with pytest.raises(ValueError):  # rows of unequal length: nothing half-written stays
        write_generations(
            tmp_path / "b", 2, [item("a", "x", "1"), item("b", "y", "2")], [0.0], [{}]
        )
    assert list((tmp_path / "b").iterdir()) == []
