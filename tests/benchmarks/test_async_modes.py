"""benchmarks/learning/async_modes.py on a couple of steps: the three modes run through the
mesh from one warm start and their figures are written."""

from __future__ import annotations

import json

import pytest

from benchmarks.learning import async_modes
from meshrl.testing.tiny_model import make_tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_three_modes_side_by_side_write_their_figures(tmp_path):
    # a small model taken as warm-started already (prepare_model keeps it): no warm start
    model = make_tiny_model_dir(tmp_path / "runs" / "model", seed=0, hidden=32, intermediate=64)
    (model / "WARM_STARTED").write_text("seed 1, 0 iterations (a test's stand-in)\n")
    out = tmp_path / "modes.json"
    small = [
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "critic.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.prompts_per_request=8",
        "data.max_response_length=8",
    ]
    args = ["--steps", "3", "--out", str(tmp_path / "runs"), "--results", str(out)]
    result = async_modes.main([*args, *[f"--override={o}" for o in small]])
    assert json.loads(out.read_text())["runs"] == result["runs"]
    assert [r["mode"] for r in result["runs"]] == ["sync", "one_step_off", "async"]
    for r in result["runs"]:
        assert r["steps"] == 3 and r["median_step_s"] > 0 and 0 <= r["acc_final"] <= 1
    fully_async = result["runs"][2]
    assert fully_async["async/staleness/max over the run"] <= 1
    assert "median timing_s/trainer_idle" in fully_async
