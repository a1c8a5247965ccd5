"""`meshrl demo`'s own bookkeeping, without a run: the summary it prints and the run folder
it clears."""

from __future__ import annotations

import json

import pytest

from meshrl.config import ConfigError
from meshrl_app.demo.run import clear_run_dir, held_out_accuracy, summarize


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_short_run_is_summarised_over_the_steps_it_has(tmp_path, capsys):
    # 3 steps at 0.6: 0.6 each way (not 3 * 0.6 / 5 = 0.36)
    write_metrics(tmp_path, [{"step": s, "critic/score/mean": 0.6} for s in (1, 2, 3)])
    assert summarize(tmp_path) == pytest.approx(0.0)
    assert "first 3 steps 0.600 -> last 3 steps 0.600" in capsys.readouterr().out


def test_the_summary_names_the_last_checkpoint_to_export(tmp_path, capsys):
    write_metrics(tmp_path, [{"step": s, "critic/score/mean": 0.5} for s in (1, 2)])
    for step in (2, 10):  # by step number, not name: global_step_10 sorts before _2
        (tmp_path / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    summarize(tmp_path)
    last = tmp_path / "checkpoints" / "global_step_10"
    assert f"model:   {last} (meshrl export {last} --to <folder>)" in capsys.readouterr().out


def test_a_step_logged_again_after_a_rewind_counts_once_with_its_later_line(tmp_path, capsys):
    rows = [{"step": s, "critic/score/mean": 0.0} for s in range(1, 8)]
    rows += [{"step": 7, "critic/score/mean": 1.0}]  # step 7 run again after a rewind
    rows += [{"step": s, "critic/score/mean": 1.0} for s in (8, 9, 10)]
    write_metrics(tmp_path, rows)
    # first 5: steps 1-5 at 0; last 5: steps 6-10 = 0, 1, 1, 1, 1
    assert summarize(tmp_path) == pytest.approx(0.8)


def test_no_metrics_file_is_said_not_raised(tmp_path, capsys):
    assert summarize(tmp_path) == 0.0  # trainer.logger without jsonl
    assert "no training steps logged" in capsys.readouterr().out


def test_only_the_demos_own_run_folder_is_cleared(tmp_path):
    out = tmp_path / "demo_out"
    own = out / "run"
    write_metrics(own, [{"step": 1, "critic/score/mean": 0.5}])
    clear_run_dir(own, out)
    assert not own.exists()

    elsewhere = tmp_path / "my_runs"  # trainer.default_local_dir=... outside --out
    (elsewhere / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"trainer\.default_local_dir=.*not empty"):
        clear_run_dir(elsewhere, out)
    assert (elsewhere / "checkpoints").is_dir()
    clear_run_dir(tmp_path / "new", out)  # a new folder elsewhere is fine


def test_the_summary_gives_held_out_accuracy_at_the_first_and_last_validation(tmp_path, capsys):
    acc = "val-core/openai/gsm8k/acc/mean@1"
    rows = [{"step": 0, acc: 0.25}]
    rows += [{"step": s, "critic/score/mean": 0.5} for s in (1, 2)]
    rows += [{"step": 2, acc: 0.5, "val-core/openai/gsm8k/reward/mean@1": 0.5}]
    write_metrics(tmp_path, rows)
    summarize(tmp_path)
    assert held_out_accuracy(rows) == [(0, 0.25), (2, 0.5)]
    assert "temperature 0): step 0 0.250 -> step 2 0.500 (+0.250)" in (capsys.readouterr().out)
