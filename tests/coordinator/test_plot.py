"""The run's metrics plot."""

import json

from services.coordinator.plot import plot_metrics


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_plot_of_the_logged_steps(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    _write(
        jsonl,
        [
            {"step": 1, "critic/score/mean": 0.2, "response_length/mean": 7.0},
            {"step": 2, "critic/score/mean": 0.4, "response_length/mean": 6.0},
            {"step": 2, "val-core/gsm8k/acc/mean@1": 0.5},
        ],
    )
    png = plot_metrics(jsonl, tmp_path / "out" / "metrics.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_plot_and_no_error_before_the_first_step(tmp_path):
    """A run that failed at set-up used to warn 'could not plot metrics: Number of columns
    must be a positive integer, not 0', which read as a bug of its own."""
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, [{"step": 0, "val-core/gsm8k/acc/mean@1": 0.5}])
    assert plot_metrics(jsonl, tmp_path / "metrics.png") is None
    assert not (tmp_path / "metrics.png").exists()
