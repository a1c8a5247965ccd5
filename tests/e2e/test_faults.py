"""Fault injection: kill -9 of each role server while it is inside its call of step 4, and of
the coordinator while the actor is inside step 3's update (then a resume from the CLI). Every
run completes its planned steps and ends with a valid checkpoint.

How a kill is pinned to its phase: every role server logs ``rpc <Method> #k started (pid P)``
as a long call begins and ``rpc <Method> #k finished|failed in S s (pid P)`` as it ends
(``meshrl/rpc/call_markers.py``). The test hook ``MESHRL_TEST_SLOW_RPC=<role>.<Method>=<s>@<k>``
holds the victim's k-th call of that method open for s seconds right after its "started" line.
A watcher thread reads the victim's log and kill -9s the server's process group on that line,
so the kill lands inside the call, whatever the machine's load. Each method below is called
once per step, so the k-th call is step k's. Afterwards the log proves where the kill landed
(started, and neither finished nor failed, by the killed pid), the coordinator's log that it
recovered from that call, and the restarted server's log that the call was served again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from meshrl.config import build_config
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import CheckpointManager, verify
from tests.e2e.kill_inside import ended_line, run_killing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 5
KILL_STEP = 4  # after step 2's checkpoint, with step 3 done since
HOLD_S = 60.0  # the kill ends the held call at once; only a missed kill would wait it out

VICTIMS = {  # case -> (launcher name, role, the call it is killed in, its index k)
    "rollout": ("rollout0", "rollout", "Generate", KILL_STEP),  # mid-generation
    "actor": ("actor", "actor", "UpdatePolicy", KILL_STEP),  # mid-update
    "critic": ("critic", "critic", "ComputeValues", KILL_STEP),
    "ref": ("ref", "ref", "ComputeLogProbs", KILL_STEP),
    "reward": ("reward", "reward", "Score", KILL_STEP),  # mid-scoring
    # After step 4's updates, inside its weight sync (call #1 is the sync before step 1):
    # the step is complete and must not be run, and so trained on, a second time.
    "rollout_in_sync": ("rollout0", "rollout", "ReceiveWeights", KILL_STEP + 1),
}


def _overrides(tiny_model, data, run_dir):
    return [
        f"data.train_files=[{data['train']}]",
        "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=10",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "algorithm.use_kl_in_reward=true",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2", "trainer.plot=false",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip


@pytest.mark.parametrize("victim", list(VICTIMS))
def test_role_server_killed_inside_its_call(
    victim, tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog
):
    name, role, method, k = VICTIMS[victim]
    monkeypatch.setenv(TEST_SLOW_ENV, f"{role}.{method}={HOLD_S}@{k}")  # servers inherit
    caplog.set_level(logging.INFO, logger="services.coordinator")
    cfg = build_config({}, _overrides(tiny_model, arithmetic_data, tmp_path))
    last, killer, new_pid, actor_log = run_killing(cfg, tmp_path, name, method, k)
    assert killer.killed.is_set(), f"{name} never started {method} #{k}"
    assert new_pid != killer.pid, "the victim was restarted"

    # the kill landed inside the call: started, never finished or failed, by the killed pid
    log_text = killer.log_path.read_text(errors="replace")
    assert killer.line in log_text
    assert not ended_line(method, k, killer.pid).search(log_text)
    # the coordinator saw step 4 fail in that call and recovered; the new server served it
    recoveries = [r.getMessage() for r in caplog.records if "recovering" in r.getMessage()]
    assert len(recoveries) == 1, recoveries
    in_sync = method == "ReceiveWeights"
    said = (
        f"step {KILL_STEP}: updated, but its weight sync failed ("
        if in_sync
        else f"step {KILL_STEP} failed ("
    )
    assert recoveries[0].startswith(said), recoveries[0]
    # in the sync, whichever end notices first names its call: the actor's send or the receive
    calls = ("SendWeights", "ReceiveWeights") if in_sync else (method,)
    assert any(f"failed during {call}" in recoveries[0] for call in calls), recoveries[0]
    assert ended_line(method, r"\d+", new_pid).search(log_text), "the restarted server served it"

    assert last["training/global_step"] == STEPS
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    steps = [r["step"] for r in rows]
    # every step generated with the weights of the step before, also the retried one: the
    # re-sync after a crash labels the actor's weights with the last step completed
    versions = [(r["step"], r["rollout/weight_version"]) for r in rows]
    assert all(v == step - 1 for step, v in versions), versions
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    if victim in ("actor", "critic"):  # training state lost: back to step 2's checkpoint
        assert steps == [1, 2, 3, 3, 4, 5]
        assert len(resumed) == 1 and resumed[0].endswith("global_step_2 (step 2)"), resumed
    else:  # stateless: the failed step was retried in place (or, updated, not at all)
        assert steps == [1, 2, 3, 4, 5] and not resumed
        # the actor (never restarted) trained exactly once per step
        assert len(re.findall(r"rpc UpdatePolicy #\d+ finished", actor_log)) == STEPS
    final = CheckpointManager(tmp_path).latest_valid()
    assert final is not None and final.name == f"global_step_{STEPS}"
    verify(final)


def _wait_for(predicate, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.02)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_coordinator_killed_then_resumed_from_cli(tiny_model, arithmetic_data, tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({}))
    cmd = [sys.executable, "-m", "meshrl_app.cli", "run", str(config),
           *_overrides(tiny_model, arithmetic_data, run_dir)]  # fmt: skip
    # held only in the first run: a few seconds are enough, its servers stop when it dies
    held = {**os.environ, TEST_SLOW_ENV: "actor.UpdatePolicy=8@3"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=held)  # fmt: skip
    actor_log = run_dir / "logs" / "actor.log"
    started = re.compile(r"rpc UpdatePolicy #3 started \(pid (\d+)\)")
    _wait_for(lambda: started.search(_read(actor_log)), "UpdatePolicy #3 on the actor")
    servers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator (role servers run in own sessions)
    at_kill = _read(actor_log)
    proc.wait()
    actor_pid = int(started.search(at_kill).group(1))
    assert not ended_line("UpdatePolicy", 3, actor_pid).search(at_kill), "killed mid-update"
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
    assert actor_pid in {p.pid for p in servers}, "the coordinator had started its role servers"
    # orphaned role servers notice their launcher is gone and stop by themselves
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"role servers left behind: {alive}"
    assert "is gone; stopping this role server" in _read(actor_log)

    plain = {k: v for k, v in os.environ.items() if k != TEST_SLOW_ENV}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=plain)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr and "global_step_2 (step 2)" in out.stderr
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # step 3 never finished before the kill
    final = CheckpointManager(run_dir).latest_valid()
    assert final is not None and final.name == f"global_step_{STEPS}"
    verify(final)


def test_rollout_killed_while_generating_ahead_one_step_off_policy(
    tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog
):
    """trainer.one_step_off_policy: Generate #4 is step 4's batch, generated during step 3's
    training. The kill lands there; step 3 trains on, its weight sync finds rollout dead, the
    launcher restarts it and syncs step 3's weights; step 4 then generates its batch itself
    from the prompts drawn for it (weight lag 0), and step 5's is generated ahead again."""
    monkeypatch.setenv(TEST_SLOW_ENV, f"rollout.Generate={HOLD_S}@4")
    caplog.set_level(logging.INFO, logger="services.coordinator")
    overrides = [*_overrides(tiny_model, arithmetic_data, tmp_path), "trainer.rollout_data_dir=gen"]
    cfg = build_config({}, [*overrides, "trainer.one_step_off_policy=true"])
    last, killer, new_pid, actor_log = run_killing(cfg, tmp_path, "rollout0", "Generate", 4)
    assert killer.killed.is_set() and new_pid != killer.pid
    log_text = killer.log_path.read_text(errors="replace")
    assert not ended_line("Generate", 4, killer.pid).search(log_text)
    recoveries = [r.getMessage() for r in caplog.records if "recovering" in r.getMessage()]
    assert len(recoveries) == 1 and recoveries[0].startswith(
        "step 3: updated, but its weight sync failed ("
    ), recoveries
    assert last["training/global_step"] == STEPS
    rows = {
        r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r
    }
    assert sorted(rows) == [1, 2, 3, 4, 5]  # no step run twice, none skipped
    assert [rows[k]["rollout/weight_version"] for k in rows] == [0, 0, 1, 3, 3]
    assert [rows[k]["rollout/weight_lag"] for k in rows] == [0, 1, 1, 0, 1]
    assert len(re.findall(r"rpc UpdatePolicy #\d+ finished", actor_log)) == STEPS
    prompts = [  # each step trained on prompts of its own (the dumps' decoded prompts)
        tuple(
            sorted(json.loads(line)["input"] for line in (tmp_path / "gen" / f"{k}.jsonl").open())
        )
        for k in rows
    ]
    assert len(set(prompts)) == STEPS
    final = CheckpointManager(tmp_path).latest_valid()
    assert final is not None and final.name == f"global_step_{STEPS}"
