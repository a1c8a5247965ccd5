"""trainer.one_step_off_policy through the mesh: every role a real server process, each
step's batch generated while the step before trained, with the weights one update behind;
a checkpoint taken with a batch generated ahead resumes at that batch's prompts."""

from __future__ import annotations

import json

import pytest

from meshrl.config import build_config
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _overrides(tiny_model, data, run_dir, steps: int, *more: str) -> list[str]:
    return [
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=gae",
        "trainer.one_step_off_policy=true",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.rollout_data_dir=rollouts",
        f"trainer.default_local_dir={run_dir}",
        *more,
    ]


def step_rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r}


def prompts_of(run_dir, step: int) -> list[str]:
    lines = (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["input"] for line in lines]


def test_a_run_one_step_off_policy_trains_on_batches_one_update_behind(
    tiny_model, arithmetic_data, tmp_path, shared_mesh
):
    on_shared = {"launcher": shared_mesh}  # both runs on the same servers, in turn
    first = tmp_path / "first"
    run_local(build_config(on_shared, _overrides(tiny_model, arithmetic_data, first, 4)))
    rows = step_rows(first)
    assert sorted(rows) == [1, 2, 3, 4]
    # step 1 generates its own batch with the model's weights (version 0); every later one
    # trains on the batch generated during the step before, from the weights before that
    assert [rows[k]["rollout/weight_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [rows[k]["rollout/weight_lag"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for k in (2, 3, 4):
        assert rows[k]["timing_s/gen"] > 0 and "timing_s/gen_wait" in rows[k]
        assert 0.0 <= rows[k]["critic/score/mean"] <= 1.0 and "actor/pg_loss" in rows[k]
    validated = [r for r in read_jsonl(first / "metrics.jsonl") if any("val-core" in k for k in r)]
    assert [r["step"] for r in validated] == [2, 4]
    batches = [tuple(prompts_of(first, k)) for k in (1, 2, 3, 4)]
    assert len(set(batches)) == 4, "each step trained on prompts of its own"

    # Resumed from step 2, whose checkpoint was saved while step 3's batch was generated
    # ahead: the run draws step 3's prompts again (with step 2's weights now: lag 0).
    again = tmp_path / "again"
    checkpoint = first / "checkpoints" / "global_step_2"
    resumed = _overrides(tiny_model, arithmetic_data, again, 4, f"trainer.resume_mode={checkpoint}")
    run_local(build_config(on_shared, resumed))
    rows = step_rows(again)
    assert sorted(rows) == [3, 4]
    assert [rows[k]["rollout/weight_version"] for k in (3, 4)] == [2, 2]
    assert [rows[k]["rollout/weight_lag"] for k in (3, 4)] == [0, 1]
    assert sorted(prompts_of(again, 3)) == sorted(batches[2])
    assert sorted(prompts_of(again, 4)) == sorted(batches[3])
