"""A short end-to-end PPO run through the local launcher: every role a real server process,
verl-named metrics in JSONL, a plot, validation, and no process left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshrl.config import build_config
from meshrl.testing.processes import role_server_pids
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import _cell, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _overrides(tiny_model, data, run_dir):
    return [
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        "data.train_batch_size=16",
        "data.max_prompt_length=16",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "algorithm.use_kl_in_reward=true",
        "trainer.total_training_steps=3",
        "trainer.test_freq=2",
        "trainer.logger=[console,jsonl,tensorboard,mlflow]",
        "trainer.log_val_generations=3",
        "trainer.rollout_data_dir=rollouts",  # under the run folder
        f"trainer.validation_data_dir={run_dir.parent / 'val_generations'}",
        f"trainer.default_local_dir={run_dir}",
    ]


def board_texts(log_dir, tag: str) -> list[tuple[int, str]]:
    """The (step, text) of a TensorBoard text summary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in events.Tensors(f"{tag}/text_summary")
    ]


def _assert_every_step_updated(steps: list[dict]) -> None:
    """The updates happened and did what they should. A step whose advantages are all 0
    (every score 0, critic and actor still where they started: step 1 of this run) has
    nothing to learn; every other step trains the actor, and the step after it sees the
    actor away from the reference."""
    import math

    for r in steps:
        for key in ("actor/pg_loss", "actor/entropy", "critic/vf_loss", "critic/advantages/mean"):
            assert math.isfinite(r[key]), (r["step"], key)
        assert r["actor/nonfinite_grad_steps"] == 0 == r["critic/nonfinite_grad_steps"]
        assert r["actor/lr"] == pytest.approx(1e-3)
    assert [r["rollout/weight_version"] for r in steps] == [0, 1, 2]
    learning = [r for r in steps if r["critic/advantages/max"] > r["critic/advantages/min"]]
    assert learning, "no step had an advantage to learn from: the run tests no update"
    for r in learning:
        assert r["actor/grad_norm"] > 0, r["step"]
        # 16 rows, mini-batches of 8: the second is scored after the first's optimizer
        # step, so the policy has moved from the rollout's.
        assert abs(r["actor/ppo_kl"]) > 1e-6, r["step"]
    # KL to the reference in the reward: none before the actor first trained (it is the
    # reference), some after.
    first = learning[0]["step"]
    assert all(abs(r["actor/reward_kl_penalty"]) < 1e-5 for r in steps if r["step"] <= first)
    assert all(abs(r["actor/reward_kl_penalty"]) > 1e-5 for r in steps if r["step"] > first)
    assert first < steps[-1]["step"], "the actor trained only at the last step"


def test_ppo_run_end_to_end(tiny_model, arithmetic_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run folder's own store
    before = role_server_pids(os.getpid())
    cfg = build_config({}, _overrides(tiny_model, arithmetic_data, tmp_path / "run"))
    last = run_local(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in [
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "critic/vf_explained_var",
        "training/rollout_probs_diff_mean",
        "actor/grad_norm",
        "actor/entropy",
        "critic/vf_loss",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/sync_weights",
        "perf/throughput",
        "actor/reward_kl_penalty",
        "critic/advantages/mean",
    ]:
        assert key in steps[-1], key
    assert 0.0 <= last["critic/score/mean"] <= 1.0
    _assert_every_step_updated(steps)
    # no GPU in this run: the per-GPU throughput is the whole run's
    assert last["perf/throughput"] == pytest.approx(
        last["perf/total_num_tokens"] / last["perf/time_per_step"]
    )
    assert last["rollout/weight_version"] == 2  # step 3 was generated with the weights of step 2
    val_keys = [k for r in rows for k in r if k.startswith("val-core/openai/gsm8k/acc/mean@1")]
    assert val_keys, "validation ran every test_freq steps"
    # the figure verl's dashboards read for GSM8k (verl's scorer reports no acc)
    assert any("val-core/openai/gsm8k/reward/mean@1" in r for r in rows), "verl's core name"
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    from tests.coordinator.test_metrics_sinks import scalars

    board = scalars(tmp_path / "run" / "tensorboard")  # `tensorboard --logdir` reads these
    assert [step for step, _ in board["critic/score/mean"]] == [1, 2, 3]
    assert [step for step, _ in board["val-core/openai/gsm8k/acc/mean@1"]] == [2, 3]
    # what the model wrote and how it was judged, per step (verl's generation dumps)
    for step in (1, 2, 3):
        lines = (tmp_path / "run" / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        assert len(samples) == 16 and {s["step"] for s in samples} == {step}
        assert {"input", "output", "gts", "score", "acc"} <= set(samples[0])
    val = sorted(p.name for p in (tmp_path / "val_generations").iterdir())
    assert val == ["2.jsonl", "3.jsonl"]
    # trainer.log_val_generations=3: the same 3 validation prompts at each validation, as
    # text in TensorBoard and an artifact of the MLflow run (which also has every metric)
    shown = {}
    for step in (2, 3):
        dumped = [
            json.loads(line)
            for line in (tmp_path / "val_generations" / f"{step}.jsonl").read_text().splitlines()
        ]
        artifact = next((tmp_path / "run" / "mlflow-artifacts").rglob(f"step_{step}.json"))
        rows = json.loads(artifact.read_text())["rows"]
        assert len(rows) == 3
        for row in rows:  # each shown sample is one of the validation's own
            assert any(
                (d["input"], d["output"], d["score"]) == (row["input"], row["output"], row["score"])
                for d in dumped
            )
        shown[step] = [row["input"] for row in rows]
    assert shown[2] == shown[3]
    texts = board_texts(tmp_path / "run" / "tensorboard", "val/generations")
    assert [step for step, _ in texts] == [2, 3]
    assert all(_cell(shown[2][0]) in text for _, text in texts)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name(cfg.trainer.project_name).experiment_id]
    )
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert role_server_pids(os.getpid()) <= before, "role servers must all be stopped"


def test_cli_rejects_bad_key_before_starting_anything(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("trainer:\n  total_training_step: 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "meshrl_app.cli", "run", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "trainer.total_training_step: unknown config key" in out.stderr
