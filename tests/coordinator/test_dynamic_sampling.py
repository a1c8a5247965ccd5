"""DAPO's dynamic sampling (algorithm.filter_groups): groups whose samples all score alike are
dropped, and further prompt batches are generated until the step has its batch."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from meshrl.config import ConfigError, build_config
from meshrl.data.loader import PromptLoader
from meshrl.ragged import Ragged
from services.coordinator.generation.generated import GeneratedBatch
from services.coordinator.roles.roles import Roles
from services.coordinator.run.preflight import check_run_config
from services.coordinator.step.batch_sources import SynchronousBatches
from services.coordinator.step.dynamic_sampling import (
    FilterGroupsExhausted,
    filter_values,
    varied_groups,
)
from services.coordinator.step.ppo_step import GEN_BATCH_SEED_STRIDE, PPOStep
from services.coordinator.step.stages import ScoredBatch, Scores
from services.coordinator.step.timing import PhaseTimer
from services.reward.types import ScoreOutcome


def test_varied_groups_keeps_groups_that_differ_and_single_samples_in_order():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([3, 3, 1, 1, 0, 0, 7])
    assert varied_groups(values, groups) == [1, 7]  # 3: all right, 0: all wrong


def test_filter_values_by_metric_as_verl_means_them():
    unshaped = torch.tensor([0.9, 1.0, 0.2])
    batch = Scores(
        scores=unshaped - torch.tensor([0.0, 0.5, 0.0]),  # an overlong penalty
        reward_scores=unshaped,
        extra=[{"acc": 1.0}, {}, {"acc": 0.0}],
    )
    assert filter_values("acc", batch).tolist() == [1.0, 1.0, 0.0]  # no acc: score >= 1
    assert filter_values("score", batch).tolist() == pytest.approx([0.9, 1.0, 0.2])  # unshaped
    assert filter_values("seq_reward", batch).tolist() == pytest.approx([0.9, 0.5, 0.2])
    # the reward the advantage sees: the KL penalty stays out of a filtering run's reward
    assert filter_values("seq_final_reward", batch).tolist() == pytest.approx([0.9, 0.5, 0.2])


def test_ragged_concat_and_batch_select_groups():
    a, b = Ragged.from_lists([[1], [2, 3]]), Ragged.from_lists([[], [4, 5, 6]])
    assert Ragged.concat([a, b]).tolist() == [[1], [2, 3], [], [4, 5, 6]]
    batch = _batch([[10], [10], [11], [11], [12], [12]], scores=[1, 0, 1, 1, 0, 1])
    picked = batch.select_groups([2, 0])
    assert picked.generated.prompts.tolist() == [[12], [12], [10], [10]]
    assert picked.generated.group_ids.tolist() == [0, 0, 1, 1]
    assert picked.scores.scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert picked.scores.reward_scores.tolist() == [0.0, 1.0, 1.0, 0.0]
    both = ScoredBatch.concat([picked, batch.select_groups([1])])
    assert both.generated.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.generated.prompts.tolist() == [[12], [12], [10], [10], [11], [11]]
    assert both.scores.scores.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def _batch(prompts, scores):
    n = len(prompts)
    generated = GeneratedBatch(
        prompts=Ragged.from_lists(prompts),
        responses=Ragged.from_lists([[7]] * n),
        rollout_logprobs=Ragged.from_lists([[0.0]] * n, dtype=torch.float32),
        finish_reasons=["stop"] * n,
        group_ids=torch.arange(n) // 2,
        data_sources=["x"] * n,
        ground_truths=[""] * n,
        extra_infos=[{}] * n,
        weight_version=0,
    )
    scored = Scores(
        scores=torch.tensor(scores, dtype=torch.float32),
        reward_scores=torch.tensor(scores, dtype=torch.float32),
        extra=[{} for _ in range(n)],
    )
    return ScoredBatch(generated, scored)


def _varied(step: PPOStep, records: list, number: int, draw) -> tuple[ScoredBatch, dict]:
    """Step ``number``'s batch from the synchronous source with dynamic sampling."""
    cfg = step.cfg
    source = SynchronousBatches(cfg.algorithm.filter_groups, cfg.data.train_batch_size, draw)
    timer = PhaseTimer()
    taken = source.take(number, records, step, timer)
    assert taken.scores is not None and taken.records == records  # scored by the source
    assert set(timer.seconds) == {"gen", "reward"}
    return ScoredBatch(taken.generated, taken.scores), taken.metrics


# --- the step's loop, over stand-in rollout and reward roles ---------------------------------
class Replica:
    """Answers prompt [p] with n samples [p, j]; records the seeds it was asked with."""

    def __init__(self):
        self.seeds: list[int] = []

    def generate(self, prompts: Ragged, sampling):
        self.seeds.append(sampling.seed)
        rows = [[row[0], j] for row in prompts.tolist() for j in range(sampling.n)]
        return SimpleNamespace(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists([[0.0, 0.0]] * len(rows), dtype=torch.float32),
            finish_reasons=["length"] * len(rows),
            weight_version=0,
            token_versions=None,
        )


class Reward:
    """Prompt p: p % 3 == 0 all right, 1 all wrong, 2 right on even samples only."""

    def score(self, items):
        out = []
        for it in items:
            p, j = map(int, it.response.split()[:2])  # then any padding tokens
            acc = 1.0 if p % 3 == 0 else 0.0 if p % 3 == 1 else float(j % 2 == 0)
            out.append(ScoreOutcome(acc, True, "", {"acc": acc}))
        return out


class Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def _step(overrides):
    cfg = build_config(
        {},
        [
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=4",
            "algorithm.filter_groups.enable=true",
            *overrides,
        ],
    )
    replica = Replica()
    roles = Roles(rollouts=[replica], actor=None, reward=Reward())
    return PPOStep(cfg, roles, Tokenizer(), syncer=None, kl_ctrl=None), replica


def _records(first: int, count: int = 4):
    return [SimpleNamespace(prompt_ids=[p], data_source="x", ground_truth="0", extra_info={}, chat="")
            for p in range(first, first + count)]  # fmt: skip


@pytest.mark.parametrize("limit", [10, 0])  # 0: no limit
def test_the_step_generates_until_it_has_a_batch_of_varied_groups(caplog, limit):
    step, replica = _step([f"algorithm.filter_groups.max_num_gen_batches={limit}"])
    drawn = []

    def draw(i):
        assert 0 < i < 10, "a runaway draw"
        drawn.append(i)
        return _records(4 * i)

    try:
        with caplog.at_level("INFO", logger="services.coordinator.step.batch_sources"):
            batch, metrics = _varied(step, _records(0), 5, draw)
    finally:
        step.close()
    assert caplog.messages == [
        "step 5: 1 of 4 prompts with varied acc after 1 generation batches; generating more",
        "step 5: 2 of 4 prompts with varied acc after 2 generation batches; generating more",
    ]
    # varied prompts: 2 | 5 | 8, 11 -> four after three generation batches
    assert drawn == [1, 2]
    assert [row[0] for row in batch.generated.prompts.tolist()[::2]] == [2, 5, 8, 11]
    assert batch.generated.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.scores.scores.tolist() == [1.0, 0.0] * 4
    assert metrics == {"train/num_gen_batches": 3.0, "train/kept_prompts_ratio": 4 / 12}
    base = replica.seeds[0]
    assert replica.seeds == [base + k * GEN_BATCH_SEED_STRIDE for k in range(3)]


def test_generation_batches_of_gen_batch_size_fill_a_train_batch():
    # verl's DAPO: batches of data.gen_batch_size prompts until train_batch_size are kept
    step, _ = _step(["data.gen_batch_size=6"])
    drawn = []

    def draw(i):
        drawn.append(i)
        return _records(6 * i, 6)

    try:
        batch, metrics = _varied(step, _records(0, 6), 2, draw)
    finally:
        step.close()
    # varied prompts: 2, 5 | 8, 11 -> four after two generation batches of six
    assert drawn == [1]
    assert [row[0] for row in batch.generated.prompts.tolist()[::2]] == [2, 5, 8, 11]
    assert metrics == {"train/num_gen_batches": 2.0, "train/kept_prompts_ratio": 4 / 12}


def test_the_loader_serves_generation_batches_and_names_their_key(tmp_path):
    from meshrl.data.errors import DataError
    from services.coordinator.run.run_data import make_loader

    cfg = build_config({}, ["data.train_batch_size=4", "data.gen_batch_size=6",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                            "critic.ppo_mini_batch_size=4"])  # fmt: skip
    loader = make_loader(cfg, list(range(20)))
    assert loader.steps_per_epoch == 3 and len(loader.next_batch()[1]) == 6
    with pytest.raises(DataError, match=r"fewer than one batch of 6 .*lower data.gen_batch_size"):
        make_loader(cfg, list(range(5)))
    plain = build_config({}, ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "critic.ppo_mini_batch_size=4"])  # fmt: skip
    with pytest.raises(DataError, match=r"lower data.train_batch_size"):
        make_loader(plain, list(range(3)))


def test_a_step_past_max_num_gen_batches_fails_naming_the_key_and_shortfall():
    step, _ = _step(["algorithm.filter_groups.max_num_gen_batches=2"])
    try:
        with pytest.raises(FilterGroupsExhausted, match=r"step 3: 2 of the 4 prompts .*"
                           r"max_num_gen_batches=2\); the data is too easy or too hard for "
                           r"the model: raise the limit, change the data, or set "
                           r"algorithm.filter_groups.enable=false$"):  # fmt: skip
            _varied(step, _records(0), 3, lambda i: _records(4 * i) if 0 < i < 10 else None)
    finally:
        step.close()


def test_run_config_checks():
    on = ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo"]
    with pytest.raises(ConfigError, match=r"rollout.n=1 gives one sample"):
        check_run_config(build_config({}, on))
    with pytest.raises(ConfigError, match="adv_estimator=remax"):
        check_run_config(
            build_config(
                {}, [*on[:1], "algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2"]
            )
        )
    check_run_config(build_config({}, [*on, "actor_rollout_ref.rollout.n=4"]))
    check_run_config(
        build_config({}, [*on, "actor_rollout_ref.rollout.n=4", "data.gen_batch_size=768"])
    )
    # ten generation batches of 16 can never keep 256 prompts: refused, not failed at step 1
    too_few = [*on, "actor_rollout_ref.rollout.n=4", "data.gen_batch_size=16"]
    with pytest.raises(ConfigError, match=r"gen_batch_size=16 x .*max_num_gen_batches=10 "
                       r"prompts are fewer than data.train_batch_size=256"):  # fmt: skip
        check_run_config(build_config({}, too_few))
    unlimited = "algorithm.filter_groups.max_num_gen_batches=0"
    check_run_config(build_config({}, [*too_few, unlimited]))
    # without dynamic sampling a generation batch is the training batch
    check_run_config(build_config({}, ["data.gen_batch_size=256"]))
    with pytest.raises(ConfigError, match=r"data.gen_batch_size=768 differs from "
                       r"data.train_batch_size=256.*filter_groups.enable=true"):  # fmt: skip
        check_run_config(build_config({}, ["data.gen_batch_size=768"]))
    final = [
        *on,
        "actor_rollout_ref.rollout.n=4",
        "algorithm.filter_groups.metric=seq_final_reward",
    ]
    check_run_config(build_config({}, [*final, "algorithm.use_kl_in_reward=false"]))
    with pytest.raises(ConfigError, match=r"metric=seq_final_reward with algorithm.use_kl_in_"
                       r"reward=true: .*before the reference log-probs"):  # fmt: skip
        check_run_config(build_config({}, [*final, "algorithm.use_kl_in_reward=true"]))
    off = build_config({}, [])
    assert not off.algorithm.filter_groups.enable
    assert off.algorithm.filter_groups.max_num_gen_batches == 10


def test_a_retried_step_draws_the_same_further_prompts(tmp_path):
    from tests.coordinator.test_run_bookkeeping import make_run

    run = make_run(tmp_path)
    run.progress.loader = PromptLoader(list(range(100)), 4, shuffle=False)
    first = run.draw_records(2)  # a step that drew two further batches, then failed
    assert run.draw_records(1) == [0, 1, 2, 3] and first == [4, 5, 6, 7]
    assert run.draw_records(2) == first  # the retry: nothing new taken from the loader
    assert run.progress.loader.state_dict()["batch_in_epoch"] == 2


# --- DAPO's soft overlong punishment, applied to the step's scores ---------------------------
def test_overlong_penalty_lands_in_the_scores_and_the_metrics():
    step, _ = _step(
        [
            "data.max_response_length=4",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=2",
            "reward.overlong_buffer.penalty_factor=1.0",
        ]
    )
    try:
        batch = step.generate(_records(0, 3), 1)
        rows = [[0, 0, 9, 9], [0, 1, 9, 9], [1, 0, 9], [1, 1, 9], [2, 0], [2, 1]]  # [p, j, ...]
        batch = replace(batch, responses=Ragged.from_lists(rows))
        scores = step.score(batch)
        metrics = step.overlong_metrics(batch)
    finally:
        step.close()
    # prompt 0: all right, 4 tokens (-1); prompt 1: all wrong, 3 tokens (-0.5); prompt 2: free
    assert scores.scores.tolist() == [0.0, 0.0, -0.5, -0.5, 1.0, 0.0]
    assert metrics == {
        "reward/overlong_reward/mean": pytest.approx(-0.5),
        "reward/overlong/mean": pytest.approx(4 / 6),
    }


def test_an_overlong_buffer_past_the_response_limit_is_refused_at_start():
    cfg = build_config({}, ["reward.overlong_buffer.enable=true"])  # len 4096 > 512 tokens
    with pytest.raises(
        ConfigError, match=r"reward.overlong_buffer.len=4096 exceeds data.max_response_length"
    ):
        check_run_config(cfg)


def test_groups_differing_only_by_the_overlong_penalty_are_kept_by_seq_reward_not_score():
    # Every sample right; sample 0 of each prompt runs into the overlong buffer. verl's
    # "score" is the reward before the penalty (no spread: dropped), its "seq_reward" after.
    def all_right_with_long_first_samples(metric):
        step, _ = _step(
            [
                "data.max_response_length=4",
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=2",
                f"algorithm.filter_groups.metric={metric}",
                "algorithm.filter_groups.max_num_gen_batches=1",
            ]
        )
        records = _records(0)
        for r in records:
            r.prompt_ids = [3 * r.prompt_ids[0]]  # p % 3 == 0: all right
        long_first = step.generate

        def generate(records, step_number, gen_batch=0):
            batch = long_first(records, step_number, gen_batch)
            rows = batch.responses.tolist()  # [p, j]: sample j of prompt p
            return replace(
                batch, responses=Ragged.from_lists([r + [9, 9] if r[1] == 0 else r for r in rows])
            )

        step.generate = generate
        try:
            return _varied(step, records, 1, lambda i: records if 0 < i < 10 else None)
        finally:
            step.close()

    batch, metrics = all_right_with_long_first_samples("seq_reward")
    assert metrics["train/kept_prompts_ratio"] == 1.0
    assert batch.scores.scores.tolist()[:2] == [0.0, 1.0]
    assert batch.scores.reward_scores.tolist()[:2] == [
        1.0,
        1.0,
    ]
    with pytest.raises(FilterGroupsExhausted, match="0 of the 4 prompts"):
        all_right_with_long_first_samples("score")


def test_remax_baseline_takes_the_same_overlong_penalty():
    step, replica = _step(
        [
            "algorithm.filter_groups.enable=false",
            "algorithm.adv_estimator=remax",
            "data.max_response_length=2",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=1",
        ]
    )
    try:
        records = _records(0, 2)
        for r in records:
            r.prompt_ids = [0]  # all right
        batch = step.generate(records, 1)
        scores = step.score(batch)
        baseline = step.greedy_baseline(records, batch, 1, PhaseTimer())
    finally:
        step.close()
    # samples and greedy answers alike are 2 tokens, at the limit: both lose the factor 1.0
    assert scores.scores.tolist() == [0.0] * 4
    assert baseline is not None and baseline.tolist() == [0.0] * 4
