"""The fault sweep: every role server killed (kill -9 of its process group) inside each RPC it
serves in a PPO step and in validation, one real run on the CPU per kill, and a table of what
came of it (docs/reliability.md, "Fault sweep").

A run: the tiny model, 3 steps, GAE (critic) and a KL penalty (ref), a checkpoint after every
step, validation at step 2 (and at the last). Each kill lands in step 2 (or in step 2's
validation, or in step 2's weight sync), held open by ``MESHRL_TEST_SLOW_RPC`` until the
watcher kills the server (``tests/e2e/kill_inside.py``). Outcomes:

- ``recovered``: the coordinator logged one recovery of that step (or its validation), the
  victim was restarted, the run reached step 3, its final checkpoint verifies, and every step
  generated with the weights of the step before it;
- steps lost: the actor's updates thrown away, finished ``UpdatePolicy`` calls beyond one a
  step (a stateful role's death rewinds to step 1's checkpoint: step 2's update, when it was
  done, is made again).

OpenWeightGroup and JoinWeightGroup form the weight-sync group once, at set-up (and again
after a recovery), SetMemoryState is called only where rollout hands GPU memory over: none of
them is an RPC of a CPU run's step.
"""

from __future__ import annotations

import logging
import re

import pytest

from meshrl.config import build_config
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import CheckpointManager, verify
from tests.e2e.kill_inside import ended_line, run_killing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 3
KILL_STEP = 2
HOLD_S = 60.0  # the kill ends the held call at once

# (launcher name, role, method, its k-th call in the server, what it is in the run).
# Generate and Score: #1 step 1, #2 step 2, #3 step 2's validation. ReceiveWeights: #1 the
# set-up's sync, #k+1 step k's. PrepareWeights: #1 and #2 the set-up's (before and after the
# group is formed), #k+2 step k's sync. SendWeights: #1 set-up, #k+1 step k's.
SWEEP = [
    ("rollout0", "rollout", "Generate", 2, "step"),
    ("rollout0", "rollout", "Generate", 3, "validation"),
    ("rollout0", "rollout", "ReceiveWeights", 3, "sync"),
    ("actor", "actor", "ComputeLogProbs", 2, "step"),
    ("actor", "actor", "UpdatePolicy", 2, "step"),
    ("actor", "actor", "PrepareWeights", 4, "sync"),
    ("actor", "actor", "SendWeights", 3, "sync"),
    ("actor", "actor", "SaveCheckpoint", 2, "checkpoint"),
    ("critic", "critic", "ComputeValues", 2, "step"),
    ("critic", "critic", "UpdateValue", 2, "step"),
    ("critic", "critic", "SaveCheckpoint", 2, "checkpoint"),
    ("ref", "ref", "ComputeLogProbs", 2, "step"),
    ("reward", "reward", "Score", 2, "step"),
    ("reward", "reward", "Score", 3, "validation"),
]
STATEFUL = ("actor", "critic")
RECOVERY_LINE = {  # how the coordinator names the failure it recovers from
    "step": f"step {KILL_STEP} failed (",
    "validation": f"validation at step {KILL_STEP} failed (",
    "sync": f"step {KILL_STEP}: updated, but its weight sync failed (",
    "checkpoint": f"checkpoint of step {KILL_STEP} failed (",
}
RESULTS: list[tuple[str, str, str, str, int]] = []  # (RPC, role, phase, outcome, steps lost)


def _overrides(tiny_model, data, run_dir):
    return [
        f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        "data.train_batch_size=4", "data.max_prompt_length=16", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "algorithm.use_kl_in_reward=true",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=2",
        "trainer.plot=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip


def _case_id(case) -> str:
    name, _, method, k, phase = case
    return f"{name}-{method}-{phase}"


@pytest.mark.parametrize("case", SWEEP, ids=[_case_id(c) for c in SWEEP])
def test_kill_inside_each_rpc(case, tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog):
    name, role, method, k, phase = case
    monkeypatch.setenv(TEST_SLOW_ENV, f"{role}.{method}={HOLD_S}@{k}")
    caplog.set_level(logging.INFO, logger="services.coordinator")
    cfg = build_config({}, _overrides(tiny_model, arithmetic_data, tmp_path))
    outcome, lost = "failed", -1
    try:
        last, killer, new_pid, actor_log = run_killing(cfg, tmp_path, name, method, k)
        assert killer.killed.is_set(), f"{name} never started {method} #{k}"
        assert new_pid != killer.pid, "the victim was restarted"
        log_text = killer.log_path.read_text(errors="replace")
        assert not ended_line(method, k, killer.pid).search(log_text), "killed inside the call"
        recoveries = [m for m in _messages(caplog) if "recovering" in m]
        assert len(recoveries) == 1, recoveries
        assert recoveries[0].startswith(RECOVERY_LINE[phase]), recoveries[0]
        assert last["training/global_step"] == STEPS
        rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
        steps = [r["step"] for r in rows]
        versions = [(r["step"], r["rollout/weight_version"]) for r in rows]
        assert all(v == step - 1 for step, v in versions), versions
        assert steps == [1, 2, 3], steps  # no step logged twice, none skipped
        resumed = [m for m in _messages(caplog) if m.startswith("resumed from")]
        if role in STATEFUL:  # training state lost: back to step 1's checkpoint
            assert len(resumed) == 1 and resumed[0].endswith("global_step_1 (step 1)"), resumed
        else:  # the step is retried in place (a sync's step is not run again)
            assert not resumed, resumed
        final = CheckpointManager(tmp_path).latest_valid()
        assert final is not None and final.name == f"global_step_{STEPS}"
        verify(final)
        # updates thrown away: the actor's finished updates beyond one a step
        lost = len(re.findall(r"rpc UpdatePolicy #\d+ finished", actor_log)) - STEPS
        outcome = "recovered"
    finally:
        RESULTS.append((method, role, phase, outcome, lost))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


@pytest.fixture(scope="module", autouse=True)
def _table(request):
    """Prints the table of the kills run once the module's runs are done (not captured)."""
    yield
    if not RESULTS:
        return
    lines = [f"{'RPC':<16} {'role':<8} {'phase':<11} {'outcome':<10} steps lost"]
    for method, role, phase, outcome, lost in RESULTS:
        lines.append(f"{method:<16} {role:<8} {phase:<11} {outcome:<10} {lost}")
    text = f"\nfault sweep (kill -9 inside each RPC of step {KILL_STEP}):\n" + "\n".join(lines)
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(text)
        return
    with capture.global_and_fixture_disabled():  # to the terminal, past pytest's capture
        print(text, flush=True)


def test_sweep_covers_every_rpc_of_a_step():
    """Every RPC the coordinator calls in a CPU run's step and validation is in the sweep."""
    swept = {(role, method) for _, role, method, _, _ in SWEEP}
    assert swept == {
        ("rollout", "Generate"), ("rollout", "ReceiveWeights"),
        ("actor", "ComputeLogProbs"), ("actor", "UpdatePolicy"), ("actor", "PrepareWeights"),
        ("actor", "SendWeights"), ("actor", "SaveCheckpoint"),
        ("critic", "ComputeValues"), ("critic", "UpdateValue"), ("critic", "SaveCheckpoint"),
        ("ref", "ComputeLogProbs"), ("reward", "Score"),
    }  # fmt: skip
