"""Metric sinks: TensorBoard event files a user opens with `tensorboard --logdir`."""

from __future__ import annotations

import importlib.util

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshrl.config import ConfigError, build_config
from services.coordinator.metrics_sinks import JsonlSink, TensorBoardSink, file_sinks
from services.coordinator.preflight import check_run_config


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_sink_writes_each_finite_metric_at_its_step(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")})
    sink.log(2, {"critic/score/mean": 0.5, "actor/pg_loss": -0.1})
    sink.close()
    got = scalars(tmp_path / "tb")
    assert got["critic/score/mean"] == [(1, 0.25), (2, 0.5)]
    assert got["actor/pg_loss"] == [(2, pytest.approx(-0.1))]  # the NaN is left out


def test_file_sinks_follow_trainer_logger_and_tensorboard_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    sinks = file_sinks(["console", "jsonl", "tensorboard"], tmp_path)
    assert [type(s) for s in sinks] == [JsonlSink, TensorBoardSink]
    assert sinks[1].log_dir == tmp_path / "tensorboard"
    for s in sinks:
        s.close()
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "elsewhere"))  # verl's variable
    (sink,) = file_sinks(["tensorboard"], tmp_path)
    assert sink.log_dir == tmp_path / "elsewhere"
    sink.close()
    assert file_sinks(["console"], tmp_path) == []


def test_tensorboard_without_its_package_is_refused_at_start(monkeypatch):
    cfg = build_config({}, ["trainer.logger=[console,tensorboard]"])
    check_run_config(cfg)  # installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(
        ConfigError, match=r"trainer.logger includes tensorboard.*meshrl\[tensorboard\]"
    ):
        check_run_config(cfg)
