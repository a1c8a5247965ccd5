"""A PPO run scored by a reward model alone (rows of HH-RLHF's data_source, verl's style
"model"), through the mesh: the reward server loads the model at Initialize, each step's
scores are its logits, validation files them under val-core, and the pairs it cut to
``max_length`` are counted each step."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.config import build_config
from meshrl.testing.tiny_model import make_tiny_reward_model_dir
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HH = "Dahoas/full-hh-rlhf"


LONG = "Q: 10+10=20 "
"""Put before every other row's question (each is 9 characters, `Q: 41+17=`; one token a
character): a rendered pair is then at least 1 + 12 + 9 = 22 tokens (BOS, this, the
question), and without it at most 1 + 9 + 8 = 18 (with a whole response), so a reward
model max_length of 20 cuts exactly the long rows' pairs, whatever the policy samples."""


def _as_reward_model_rows(src, dest):
    """The arithmetic rows as a reward model's: HH-RLHF's data_source, no ground truth,
    every other question made longer."""
    table = pq.read_table(src).to_pylist()
    for i, row in enumerate(table):
        row["data_source"] = HH
        row["reward_model"] = {"style": "model", "ground_truth": ""}
        if i % 2:
            row["prompt"] = [{**m, "content": LONG + m["content"]} for m in row["prompt"]]
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
            "data.max_prompt_length=32",
            "data.max_response_length=8",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "algorithm.adv_estimator=grpo",
            "reward.reward_model.enable=true",
            f"reward.reward_model.path={rm}",
            "reward.reward_model.max_length=20",  # cuts the long rows' pairs (LONG)
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
        # logits of a random head: not the zeros of a missing scorer, and not all alike
        assert row["critic/score/max"] > row["critic/score/min"]
        # each sample's record: the model's score, and whether its pair was cut (exactly
        # the long rows'), which the step's metric counts
        samples = read_jsonl(run_dir / "rollouts" / f"{row['step']}.jsonl")
        assert all(s["score"] == pytest.approx(s["rm_score"]) for s in samples)
        assert [s["rm_cut"] for s in samples] == [float(LONG in s["input"]) for s in samples]
        cut = sum(s["rm_cut"] for s in samples) / len(samples)
        assert row["reward/rm_clip_ratio"] == pytest.approx(cut)
    assert f"val-core/{HH}/reward/mean@1" in steps[-1]
    assert not [k for k in steps[-1] if k.startswith("val-core/") and "/acc/" in k]
    every = [s for k in (1, 2) for s in read_jsonl(run_dir / "rollouts" / f"{k}.jsonl")]
    assert {s["rm_cut"] for s in every} == {0.0, 1.0}, "some pairs cut, some whole"
