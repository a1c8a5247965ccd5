"""The run's metrics plot."""

import json

from services.coordinator.metrics.plot import plot_metrics


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


def test_a_rewound_run_is_drawn_as_its_latest_history_never_going_back(tmp_path, monkeypatch):
    """A run that logged steps 1 to 5, went back to its checkpoint at step 3 and ran on to
    step 6 (metrics.jsonl: 1, 2, 3, 4, 5, 4, 5, 6). Before, the lines went from step 5
    back to step 4."""
    import matplotlib.axes

    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def spy(ax, xs, ys, *args, **kwargs):
        drawn.append((list(xs), list(ys)))
        return real_plot(ax, xs, ys, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    first = [{"step": s, "critic/score/mean": 0.1 * s} for s in range(1, 6)]
    again = [{"step": s, "critic/score/mean": 1.0 + s} for s in (4, 5, 6)]
    val = [{"step": 4, "val-core/gsm8k/acc/mean@1": 0.3}]  # of the abandoned step 4
    jsonl = tmp_path / "metrics.jsonl"
    _write(jsonl, first[:4] + val + first[4:] + again)
    assert plot_metrics(jsonl, tmp_path / "metrics.png") is not None
    [(xs, ys)] = drawn  # the score; no validation left in the latest history
    assert xs == [1, 2, 3, 4, 5, 6]
    assert ys == [0.1, 0.2, 0.30000000000000004, 5.0, 6.0, 7.0]  # steps 4-6 of the rerun
