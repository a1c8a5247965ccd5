"""trainer.async_training through the mesh: every role a real server process, rollout
generating into the buffer while the trainers train, each step's samples at most
max_staleness versions behind, the async metrics in metrics.jsonl; a checkpoint taken with
prompts drawn ahead resumes at them."""

from __future__ import annotations

import pytest

from meshrl.config import build_config
from meshrl_app.run_local import run_local
from tests.e2e.test_one_step_off_policy import _overrides, prompts_of, step_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ASYNC = [
    "trainer.one_step_off_policy=false",
    "trainer.async_training.enable=true",
    "trainer.async_training.max_staleness=1",
    "trainer.async_training.buffer_batches=2",
    "actor_rollout_ref.rollout.prompts_per_request=4",  # two requests a batch
]


def test_a_fully_async_run_keeps_the_bound_and_logs_its_metrics(
    tiny_model, arithmetic_data, tmp_path, shared_mesh
):
    on_shared = {"launcher": shared_mesh}
    first = tmp_path / "first"
    run_local(build_config(on_shared, _overrides(tiny_model, arithmetic_data, first, 4, *ASYNC)))
    rows = step_rows(first)
    assert sorted(rows) == [1, 2, 3, 4]
    for k, row in rows.items():
        assert 0 <= row["async/staleness/max"] <= 1
        assert row["async/staleness/lag_0"] + row["async/staleness/lag_1"] == pytest.approx(1)
        assert row["async/dropped_samples"] == 0  # stale=wait: rollout waited instead
        assert row["async/buffer_depth"] >= 1
        assert row["timing_s/trainer_idle"] >= 0 and row["timing_s/rollout_idle"] >= 0
        assert row["timing_s/gen_drain"] >= 0  # no partial rollouts: requests drained
        assert row["weight_sync/version"] == k
        # decoupled PPO: the behaviour log-probs reached the actor (tis cap 2 by default)
        assert "training/rollout_probs_diff_mean" in row and "actor/pg_loss" in row
    assert rows[1]["async/staleness/max"] == 0  # all of step 1 is of the model's weights
    batches = [tuple(prompts_of(first, k)) for k in (1, 2, 3, 4)]
    assert len(set(batches)) == 4, "each step trained on prompts of its own"

    # Resumed from step 2, saved while rollout had generated step 3's prompts already:
    # the run draws and generates them again.
    again = tmp_path / "again"
    checkpoint = first / "checkpoints" / "global_step_2"
    resumed = _overrides(
        tiny_model, arithmetic_data, again, 4, *ASYNC, f"trainer.resume_mode={checkpoint}"
    )
    run_local(build_config(on_shared, resumed))
    rows = step_rows(again)
    assert sorted(rows) == [3, 4]
    assert sorted(prompts_of(again, 3)) == sorted(batches[2])
    assert sorted(prompts_of(again, 4)) == sorted(batches[3])


def test_with_partial_rollouts_the_sync_runs_beside_generation(
    tiny_model, arithmetic_data, tmp_path, shared_mesh
):
    # The rollout server applies a sync that comes during a Generate call at a token
    # boundary (or after the call, as a server that serializes them): either way each
    # token's version is what the step counts.
    run_dir = tmp_path / "partial"
    overrides = _overrides(
        tiny_model,
        arithmetic_data,
        run_dir,
        3,
        *ASYNC,
        "actor_rollout_ref.rollout.partial_rollout=true",
        "trainer.save_freq=-1",
    )
    run_local(build_config({"launcher": shared_mesh}, overrides))
    rows = step_rows(run_dir)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        assert 0 <= row["async/staleness/max"] <= 1
        assert "timing_s/gen_drain" not in row  # nothing held back for the sync
