"""A reward function that fails on every sample ends a real run at its first step, with the
reason, instead of training on rewards that are all 0."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from meshrl.testing.processes import without_exit_warnings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OLD_SIGNATURE = """
def compute_score(solution_str, ground_truth):  # not the (data_source, solution_str, ...) form
    return 1.0
"""


def test_a_reward_function_that_fails_every_sample_stops_the_run(
    tiny_model, arithmetic_data, tmp_path
):
    reward = tmp_path / "reward.py"
    reward.write_text(OLD_SIGNATURE)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({}))
    cmd = [sys.executable, "-m", "meshrl_app.cli", "run", str(config),
           f"data.train_files=[{arithmetic_data['train']}]",
           "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=8",
           f"actor_rollout_ref.model.path={tiny_model}", "algorithm.adv_estimator=grpo",
           "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2",
           f"reward.custom_function={reward}:compute_score",
           "trainer.total_training_steps=3", "trainer.logger=[jsonl]", "trainer.plot=false",
           f"trainer.default_local_dir={run_dir}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 1, out.stderr[-3000:]
    last = without_exit_warnings(out.stderr).splitlines()[-1]
    assert last.startswith("meshrl: reward: 16 of 16 samples could not be scored"), last
    assert "compute_score() takes 2 positional arguments but 4 were given" in last
    assert "the run stops here rather than train on zeros" in last
    assert "Traceback" not in out.stderr
    assert (
        not (run_dir / "metrics.jsonl").exists()
        or "critic/score/mean" not in (run_dir / "metrics.jsonl").read_text()
    )  # no step was logged
