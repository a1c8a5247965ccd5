"""The rollout pool through real servers: one of three rollout replicas kill -9ed inside a
Generate call loses no prompt (its requests go to the other two) and rejoins after a
restart and a weight sync; a rollout server added during a run serves requests only after
it reports the run's weight version."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest

from meshrl.config import build_config
from meshrl.launcher.local import LocalLauncher
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.run.run import PPORun
from tests.e2e.kill_inside import ended_line, run_killing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 4
KILL_CALL = 4  # rollout1's 4th Generate: step 2 (8 requests of one prompt over 3 replicas)
HOLD_S = 3.0  # every replica holds its 4th call this long: the kill lands inside rollout1's


def _overrides(tiny_model, data, run_dir, *more: str) -> list[str]:
    return [
        f"data.train_files=[{data['train']}]",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=10",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=2",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1", "trainer.plot=false",
        "trainer.logger=[jsonl]", "trainer.rollout_data_dir=rollouts",
        f"trainer.default_local_dir={run_dir}", *more,
    ]  # fmt: skip


def step_rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r}


@pytest.mark.parametrize("delta", [False, True], ids=["full_syncs", "delta_syncs"])
def test_a_replica_killed_mid_generation_loses_no_prompt_and_rejoins(
    tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog, delta
):
    """With delta syncs, the step whose pool lost the replica syncs the two others in a new
    group (a full sync), the restarted replica joins through a full sync of a new group of
    three, and every later step is a delta again, each tensor's checksum checked."""
    monkeypatch.setenv(TEST_SLOW_ENV, f"rollout.Generate={HOLD_S}@{KILL_CALL}")
    caplog.set_level(logging.INFO, logger="services.coordinator")
    cfg = build_config(
        {},
        _overrides(
            tiny_model, arithmetic_data, tmp_path,
            "actor_rollout_ref.rollout.replicas=3", "actor_rollout_ref.rollout.prompts_per_request=1",
            f"actor_rollout_ref.rollout.weight_sync.delta={str(delta).lower()}",
        ),
    )  # fmt: skip
    last, killer, new_pid, _ = run_killing(cfg, tmp_path, "rollout1", "Generate", KILL_CALL)
    assert killer.killed.is_set(), "rollout1 never started Generate #4"
    log_text = killer.log_path.read_text(errors="replace")
    assert not ended_line("Generate", KILL_CALL, killer.pid).search(log_text), "killed mid-call"
    assert new_pid != killer.pid and ended_line("Generate", r"\d+", new_pid).search(log_text)

    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "recovering" in m], "the pool, not a recovery, coped"
    assert any(m.startswith("rollout replica rollout1 left the pool") for m in messages)
    assert "rollout replica rollout1 joined the pool with weight version" in "\n".join(messages)

    assert last["training/global_step"] == STEPS
    rows = step_rows(tmp_path)
    assert sorted(rows) == list(range(1, STEPS + 1))  # no step failed or ran twice
    killed_in = [k for k, r in rows.items() if r["rollout/resent_requests"] > 0]
    assert len(killed_in) == 1, {k: r["rollout/resent_requests"] for k, r in rows.items()}
    k = killed_in[0]
    assert rows[k]["rollout/replicas"] == 2  # it left in step k ...
    assert all(rows[j]["rollout/replicas"] == 3 for j in rows if j != k)  # ... and came back
    assert rows[k + 1]["rollout/replica/1/requests"] > 0  # the restarted one serves again
    assert all(rows[j]["rollout/weight_version"] == j - 1 for j in rows)
    for step in rows:  # every prompt of every step generated and scored: 8 prompts x n=2
        lines = (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        assert len(lines) == 16
    if delta:  # the setup's sync and the rejoin's are full ones, outside the step rows
        kinds = {j: r["weight_sync/delta"] for j, r in rows.items()}
        assert kinds == {j: 0.0 if j == k else 1.0 for j in rows}, kinds
        fractions = {j: r["weight_sync/changed_fraction"] for j, r in rows.items()}
        assert fractions[k] == 1.0 and all(0 <= f <= 1 for f in fractions.values()), fractions
    else:
        assert not any("weight_sync/delta" in r for r in rows.values())


def test_a_replica_added_during_a_run_serves_after_proving_its_version(
    tiny_model, arithmetic_data, tmp_path, caplog
):
    """The launcher starts two rollout servers; the run gets only rollout0 and, after step
    1, is asked to add the other (as `meshrl rollout add` asks the coordinator service)."""
    caplog.set_level(logging.INFO, logger="services.coordinator")
    cfg = build_config(
        {},
        _overrides(
            tiny_model, arithmetic_data, tmp_path,
            "actor_rollout_ref.rollout.replicas=2", "actor_rollout_ref.rollout.prompts_per_request=2",
        ),
    )  # fmt: skip
    with LocalLauncher(cfg, tmp_path) as launcher:
        endpoints = launcher.start()
        spare = endpoints.rollout[1]
        spare_log = launcher.processes["rollout1"].log_path
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.actor_rollout_ref.rollout.replicas = 1
        run = PPORun(run_cfg, replace(endpoints, rollout=endpoints.rollout[:1]), tmp_path)

        def add_after_step_1(step, metrics):
            if step == 1:
                run.membership.ask_add(spare)

        run.on_step = add_after_step_1
        try:
            run.setup()
            run.train()
        finally:
            run.close()
    rows = step_rows(tmp_path)
    assert [rows[k]["rollout/replicas"] for k in sorted(rows)] == [1, 2, 2, 2]
    assert "rollout/replica/1/requests" not in rows[1]
    assert all(rows[k]["rollout/replica/1/requests"] > 0 for k in (2, 3, 4))
    assert all(rows[j]["rollout/weight_version"] == j - 1 for j in rows)
    joined = [r.getMessage() for r in caplog.records if "joined the pool" in r.getMessage()]
    assert joined == ["rollout replica rollout1 joined the pool with weight version 1"]
    # its first Generate came after it received the run's weights (step 1's, version 1)
    text = spare_log.read_text(errors="replace")
    received = re.search(r"rpc ReceiveWeights #\d+ finished", text)
    generated = re.search(r"rpc Generate #1 started", text)
    assert received and generated and received.start() < generated.start()
