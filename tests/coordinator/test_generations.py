"""Generations written out per step (verl's trainer.rollout_data_dir / validation_data_dir)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from meshrl.config import build_config
from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.metrics.generations import (
    GenerationRow,
    generations_dir,
    pick_shown,
    write_generations,
)
from services.coordinator.roles.roles import Roles
from services.coordinator.run.validation import validate
from services.coordinator.step.ppo_step import PPOStep
from services.coordinator.step.stages import ScoredBatch
from services.coordinator.step.timing import PhaseTimer
from services.reward.types import ScoreItem, ScoreOutcome


def item(prompt: str, response: str, ground_truth: str) -> ScoreItem:
    """A sample as GeneratedBatch.reward_items gives it."""
    return ScoreItem("openai/gsm8k", response, ground_truth, prompt)


def test_a_step_file_holds_one_line_a_sample_with_text_truth_score_and_extras(tmp_path):
    path = write_generations(
        tmp_path / "rollouts",
        7,
        [item("1+2=", "3 #### 3", "3"), item("3+4=", "8", "7")],
        [1.0, 0.0],
        [{"acc": 1.0, "rule_score": 1.0}, {"acc": 0.0, "odd": float("nan")}],
    )
    assert path == tmp_path / "rollouts" / "7.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"input": "1+2=", "output": "3 #### 3", "gts": "3", "score": 1.0, "step": 7,
         "acc": 1.0, "rule_score": 1.0},
        {"input": "3+4=", "output": "8", "gts": "7", "score": 0.0, "step": 7, "acc": 0.0},
    ]  # fmt: skip
    assert [p.name for p in path.parent.iterdir()] == ["7.jsonl"]  # no temporary file left


def test_the_folder_is_off_by_default_and_relative_to_the_run_folder(tmp_path):
    assert generations_dir(None, tmp_path) is None and generations_dir("", tmp_path) is None
    assert generations_dir("rollouts", tmp_path) == tmp_path / "rollouts"
    assert generations_dir(str(tmp_path / "abs"), tmp_path / "run") == tmp_path / "abs"


def test_text_in_any_script_is_written_as_utf8_and_a_failed_write_leaves_no_file(tmp_path):
    path = write_generations(tmp_path, 1, [item("问题 ½", "答案 é", "42")], [1.0], [{}])
    assert json.loads(path.read_text(encoding="utf-8"))["input"] == "问题 ½"
    with pytest.raises(ValueError):  # rows of unequal length: nothing half-written stays
        write_generations(
            tmp_path / "b", 2, [item("a", "x", "1"), item("b", "y", "2")], [0.0], [{}]
        )
    assert list((tmp_path / "b").iterdir()) == []


def test_a_sample_the_reward_service_could_not_score_says_why(tmp_path):
    # its score 0 is no verdict on the answer: the line tells it from a wrong one
    path = write_generations(
        tmp_path,
        3,
        [item("1+2=", "4", "3"), item("3+4=", "7", "7")],
        [0.0, 0.0],
        [{"acc": 0.0}, {}],
        ["", "timeout after 10.0s"],
    )
    wrong, unscored = [json.loads(x) for x in path.read_text().splitlines()]
    assert "reward_failure" not in wrong and wrong["acc"] == 0.0
    assert unscored["reward_failure"] == "timeout after 10.0s" and unscored["score"] == 0.0


class Tokenizer:
    """Token ids as their numbers, space-separated."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


class Reward:
    """Scores response [p] 1.0 for an even p; a response [13] makes its scorer raise."""

    def score(self, items):
        return [
            ScoreOutcome(0.0, False, "ValueError: bad ground truth", {})
            if it.response == "13"
            else ScoreOutcome(float(int(it.response) % 2 == 0), True, "", {"acc": 1.0})
            for it in items
        ]


def test_a_step_dump_says_why_a_sample_was_not_scored_after_groups_are_picked(tmp_path):
    rows = Ragged.from_lists([[10], [13], [12]])
    batch = GeneratedBatch(
        prompts=rows,
        responses=rows,
        rollout_logprobs=rows.with_values(torch.zeros(3)),
        finish_reasons=["stop"] * 3,
        group_ids=torch.arange(3),
        data_sources=["x"] * 3,
        ground_truths=["0"] * 3,
        extra_infos=[{}] * 3,
        weight_version=0,
    )
    roles = Roles(rollouts=[], actor=None, reward=Reward())
    step = PPOStep(build_config({}), roles, Tokenizer(), None, None, tmp_path / "rollouts")
    try:
        scored = ScoredBatch(batch, step.score(batch))
        # dynamic sampling keeps some groups, in another order: each reason follows its sample
        step.write_generations(scored.select_groups([1, 2]), 4, PhaseTimer())
    finally:
        step.close()
    lines = [json.loads(x) for x in (tmp_path / "rollouts" / "4.jsonl").read_text().splitlines()]
    assert [(x["output"], x.get("reward_failure")) for x in lines] == [
        ("13", "ValueError: bad ground truth"),
        ("12", None),
    ]


class Replica:
    """Answers prompt [p] with [p]."""

    def generate(self, prompts, sampling):
        return SimpleNamespace(
            responses=prompts,
            logprobs=prompts.with_values(torch.zeros(prompts.values.numel())),
            finish_reasons=["stop"] * len(prompts),
            weight_version=0,
            token_versions=None,
        )


def one_replica() -> RolloutPool:
    return RolloutPool({"rollout0": Replica()}, configured_replicas=1)


def test_a_validation_dump_says_why_a_sample_was_not_scored(tmp_path):
    records = [
        SimpleNamespace(prompt_ids=[p], data_source="x", ground_truth="0", extra_info={}, chat="")
        for p in (10, 13)
    ]
    validate(build_config({}), records, one_replica(), Reward(), Tokenizer(), tmp_path, 2)
    lines = [json.loads(x) for x in (tmp_path / "2.jsonl").read_text().splitlines()]
    assert [x.get("reward_failure") for x in lines] == [None, "ValueError: bad ground truth"]


def test_validation_hands_its_samples_to_the_loggers_tables(tmp_path):
    records = [
        SimpleNamespace(prompt_ids=[p], data_source="x", ground_truth="0", extra_info={}, chat="")
        for p in (10, 13, 12)
    ]
    shown = []
    validate(build_config({}), records, one_replica(), Reward(), Tokenizer(), None, 2, shown)
    assert shown == [("10", "10", 1.0), ("13", "13", 0.0), ("12", "12", 1.0)]


def test_the_shown_samples_are_the_same_prompts_at_every_validation():
    # verl's pick: sorted by input, shuffled with a fixed seed, the first few; so a table
    # follows the same prompts as the outputs change
    first = [GenerationRow(f"q{i}", f"a{i}", 0.0) for i in range(20)]
    later = [GenerationRow(r.input, r.output + " better", 1.0) for r in reversed(first)]
    picked, again = pick_shown(first, 4, seed=1), pick_shown(later, 4, seed=1)
    assert len(picked) == 4 and [r.input for r in picked] == [r.input for r in again]
    assert [r.input for r in pick_shown(first, 4, seed=2)] != [r.input for r in picked]
    assert pick_shown(first[:2], 4, seed=1) != [] and len(pick_shown(first[:2], 4, seed=1)) == 2


class RecordingReward(Reward):
    """Reward, keeping the prompt of every item it is sent."""

    def __init__(self):
        self.prompts: list[str] = []

    def score(self, items):
        self.prompts += [it.prompt for it in items]
        return super().score(items)


def test_the_reward_service_gets_each_rows_chat_and_the_files_the_decoded_prompt(tmp_path):
    """A reward model renders the row's messages with its own chat template; the generation
    files and tables show the prompt as the policy read it."""
    records = [
        SimpleNamespace(
            prompt_ids=[p], data_source="x", ground_truth="0", extra_info={},
            chat=json.dumps([{"role": "user", "content": f"q{p}"}]),
        )
        for p in (10, 12)
    ]  # fmt: skip
    chats = [r.chat for r in records]
    reward = RecordingReward()
    cfg = build_config({}, ["actor_rollout_ref.rollout.n=1"])
    roles = Roles(rollouts=[Replica()], actor=None, reward=reward)
    step = PPOStep(cfg, roles, Tokenizer(), None, None, tmp_path / "rollouts")
    try:
        batch = step.generate(records, step=1)
        step.write_generations(ScoredBatch(batch, step.score(batch)), 1, PhaseTimer())
    finally:
        step.close()
    assert reward.prompts == chats
    lines = [json.loads(x) for x in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert [x["input"] for x in lines] == ["10", "12"]

    reward.prompts.clear()
    shown = []
    validate(cfg, records, one_replica(), reward, Tokenizer(), tmp_path / "val", 2, shown)
    assert reward.prompts == chats
    assert [row.input for row in shown] == ["10", "12"]


def test_validation_of_a_reward_model_alone_reports_its_reward_as_the_core_metric():
    """A reward model's score carries no acc: verl then files the reward under val-core.
    Before, an accuracy of score >= 1 was made up (0.0 for every reward-model logit here)."""

    class RewardModelOnly:
        def score(self, items):
            return [
                ScoreOutcome(0.25 * int(it.response), True, "", {"rm_score": 0.0}) for it in items
            ]

    records = [
        SimpleNamespace(prompt_ids=[p], data_source="hh", ground_truth="", extra_info={}, chat="")
        for p in (1, 3)
    ]
    m = validate(build_config({}), records, one_replica(), RewardModelOnly(), Tokenizer(), None, 2)
    assert m["val-core/hh/reward/mean@1"] == pytest.approx(0.5)
    assert not [k for k in m if "/acc/" in k]
