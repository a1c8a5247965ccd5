"""What `meshrl run` tells its user, from a real local run of the tiny model: the slow
calls it waits on as they last, the step it resumes from and the steps left, and a last
line that names only what its folder holds."""

from __future__ import annotations

import pytest

from meshrl import progress_ticker
from meshrl_app import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _args(tiny_model, data, run_dir, steps: int) -> list[str]:
    return [
        "run",
        str(run_dir.parent / "run.yaml"),
        f"data.train_files={data['train']}",  # verl's spelling: one file, no brackets
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.logger=console",  # verl's quick start: no metrics.jsonl is written
        f"trainer.default_local_dir={run_dir}",
    ]


def test_a_run_says_what_it_waits_on_where_it_resumes_and_what_it_kept(
    tiny_model, arithmetic_data, tmp_path, monkeypatch, caplog, capsys
):
    # The first weight sync and step 1's generation held 2.5 s on the servers (the test
    # hook of meshrl/rpc/call_markers.py), a progress line due every 1 s (10 s in a run).
    monkeypatch.setenv("MESHRL_TEST_SLOW_RPC", "rollout.ReceiveWeights=2.5@1,Generate=2.5@1")
    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 1.0)
    (tmp_path / "run.yaml").write_text("{}\n")
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert cli.main(_args(tiny_model, arithmetic_data, run_dir, 1)) == 0
    said = [r.getMessage() for r in caplog.records]
    waits = [line for line in said if line.startswith("still waiting: ")]
    assert any("rollout ReceiveWeights (" in line for line in waits), said
    assert any("rollout Generate (" in line for line in waits), said
    assert "running 1 PPO step" in said
    # before: `(metrics.jsonl, checkpoints/)` though trainer.logger=console writes no file
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"meshrl: run finished at step 1 of 1; run folder {run_dir} (checkpoints/global_step_1)"
    )

    caplog.clear()
    monkeypatch.delenv("MESHRL_TEST_SLOW_RPC")
    with caplog.at_level("INFO"):
        assert cli.main(_args(tiny_model, arithmetic_data, run_dir, 2)) == 0
    said = [r.getMessage() for r in caplog.records]
    # before: `running 2 PPO steps`, and no word of the checkpoint it resumed from
    resumed = f"resumed from {run_dir}/checkpoints/global_step_1 (step 1); running 1 of 2"
    assert f"{resumed} PPO steps" in said
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"meshrl: run finished at step 2 of 2; run folder {run_dir} (checkpoints/global_step_2)"
    )
