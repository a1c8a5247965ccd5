"""A PPO run scored by a reward model alone (rows of HH-RLHF's data_source, verl's style
"model"), through the mesh: the reward server loads the model at Initialize, each step's
scores are its logits, validation files them under val-core, and the pairs it cut to
``max_length`` are counted each step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.config import build_config
from meshrl.launcher.run_local import run_local
from meshrl.testing.tiny_model import make_tiny_reward_model_dir
from services.coordinator.metrics_sinks import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HH = "Dahoas/full-hh-rlhf"


def _as_reward_model_rows(src, dest):
    """The arithmetic rows as a reward model's: HH-RLHF's data_source, no ground truth."""
    table = pq.read_table(src).to_pylist()
    for row in table:
        row["data_source"] = HH
        row["reward_model"] = {"style": "model", "ground_truth": ""}
    pq.write_table(pa.Table.from_pylist(table), dest)
    return dest


def test_a_run_scored_by_a_reward_model_alone(tiny_model, arithmetic_data, tmp_path, shared_mesh):
    train = _as_reward_model_rows(arithmetic_data["train"], tmp_path / "hh_train.parquet")
    test = _as_reward_model_rows(arithmetic_data["test"], tmp_path / "hh_test.parquet")
    rm = make_tiny_reward_model_dir(tmp_path / "rm")
    run_dir = tmp_path / "run"
    cfg = build_config(
        {"launcher": shared_mesh},  # the reward server loads the model at Initialize
        [
            f"data.train_files=[{train}]",
            f"data.val_files=[{test}]",
            "data.train_batch_size=8",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "algorithm.adv_estimator=grpo",
            "reward.reward_model.enable=true",
            f"reward.reward_model.path={rm}",
            # a rendered pair is a BOS, the prompt's ~10 characters and up to 8 of the
            # response: some pairs are longer than this, some not
            "reward.reward_model.max_length=16",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.rollout_data_dir=rollouts",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            f"trainer.default_local_dir={run_dir}",
        ],
    )
    last = run_local(cfg)
    assert last.finished
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert row["reward/failed_samples"] == 0
        assert 0.0 < row["reward/rm_clip_ratio"] < 1.0, row["reward/rm_clip_ratio"]
        # logits of a random head: not the zeros of a missing scorer, and not all alike
        assert row["critic/score/max"] > row["critic/score/min"]
    assert f"val-core/{HH}/reward/mean@1" in steps[-1]
    assert not [k for k in steps[-1] if k.startswith("val-core/") and "/acc/" in k]
    # each sample's record: the model's score, and whether its pair was cut
    samples = read_jsonl(run_dir / "rollouts" / "1.jsonl")
    assert {s["rm_cut"] for s in samples} == {0.0, 1.0}
    assert all(s["score"] == pytest.approx(s["rm_score"]) for s in samples)
