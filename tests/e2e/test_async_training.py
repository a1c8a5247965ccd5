"""trainer.async_training through the mesh: every role a real server process, rollout
generating into the buffer while the trainers train, each step's samples at most
max_staleness versions behind, the async metrics in metrics.jsonl; a checkpoint taken with
prompts drawn ahead resumes at them; partial rollouts; a replica killed mid-generation."""

from __future__ import annotations

import json
import logging

import pytest

from meshrl.config import build_config
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from meshrl_app.run_local import run_local
from tests.e2e.kill_inside import run_killing
from tests.e2e.test_one_step_off_policy import _overrides, prompts_of, step_rows
from tests.e2e.test_rollout_replicas import HOLD_S, KILL_CALL, STEPS
from tests.e2e.test_rollout_replicas import _overrides as replica_overrides
from tests.e2e.test_rollout_replicas import step_rows as replica_step_rows

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


def test_a_replica_killed_mid_generation_loses_no_prompt_in_async_mode(
    tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog
):
    """kill -9 of one of three rollout replicas inside a Generate call of the producer: its
    requests go to the other two, it rejoins at a step boundary, the run finishes, every
    prompt trained once and none scored as a failure."""
    monkeypatch.setenv(TEST_SLOW_ENV, f"rollout.Generate={HOLD_S}@{KILL_CALL}")
    caplog.set_level(logging.INFO, logger="services.coordinator")
    overrides = replica_overrides(
        tiny_model,
        arithmetic_data,
        tmp_path,
        *ASYNC[1:4],
        "actor_rollout_ref.rollout.replicas=3",
        "actor_rollout_ref.rollout.prompts_per_request=1",
    )
    cfg = build_config({}, overrides)
    last, killer, _, _ = run_killing(cfg, tmp_path, "rollout1", "Generate", KILL_CALL)
    assert killer.killed.is_set(), "rollout1 never started Generate #4"
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "rollout replica rollout1 left the pool" in messages
    assert "rollout replica rollout1 joined the pool with weight version" in messages
    assert "recovering" not in messages, "the pool, not a recovery, coped"
    assert last["training/global_step"] == STEPS
    rows = replica_step_rows(tmp_path)
    assert sorted(rows) == list(range(1, STEPS + 1))
    assert sum(r["rollout/resent_requests"] for r in rows.values()) >= 1
    trained = []
    for step, row in rows.items():
        assert row["async/staleness/max"] <= 1 and row["reward/failed_samples"] == 0
        lines = (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        assert len(lines) == 16  # 8 prompts x n=2
        trained += [json.loads(line)["input"] for line in lines[::2]]
    assert len(trained) == len(set(trained)) == 8 * STEPS  # none lost, none twice
