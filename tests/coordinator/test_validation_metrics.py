"""Validation metrics over n samples a prompt: verl's names, sections and bootstrap values."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.config import build_config
from services.coordinator.metrics.validation_metrics import (
    SampleResult,
    bootstrap_majority,
    subset_sizes,
    validation_metrics,
)


def samples(ds: str, accs: list[list[float]], preds: list[list[str]] | None = None):
    out = []
    for p, group in enumerate(accs):
        for j, acc in enumerate(group):
            pred = preds[p][j] if preds is not None else None
            out.append(SampleResult(ds, p, {"acc": acc, "reward": acc * 2}, pred))
    return out


def test_subset_sizes_are_verls():
    assert subset_sizes(1) == []
    assert subset_sizes(2) == [2]
    assert subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5]
    assert subset_sizes(8) == [2, 4, 8]


def test_one_sample_a_prompt_gives_the_means_only():
    m = validation_metrics(samples("gsm8k", [[1.0], [0.0], [1.0], [1.0]]))
    assert m == {"val-core/gsm8k/acc/mean@1": 0.75, "val-aux/gsm8k/reward/mean@1": 1.5}


def test_names_and_sections_for_four_samples():
    m = validation_metrics(samples("math", [[1, 0, 0, 0], [1, 1, 0, 1]], [list("abcd")] * 2))
    core = sorted(k for k in m if k.startswith("val-core/"))
    # verl's split: the accuracy's mean, maj and best at the full n are core
    assert core == [
        "val-core/math/acc/best@4/mean",
        "val-core/math/acc/best@4/std",
        "val-core/math/acc/maj@4/mean",
        "val-core/math/acc/maj@4/std",
        "val-core/math/acc/mean@4",
    ]
    assert "val-aux/math/acc/best@2/mean" in m and "val-aux/math/acc/worst@4/mean" in m
    assert "val-aux/math/acc/std@4" in m and "val-aux/math/reward/maj@4/mean" in m
    assert m["val-core/math/acc/mean@4"] == pytest.approx((0.25 + 0.75) / 2)
    assert m["val-aux/math/acc/std@4"] == pytest.approx(
        (np.std([1, 0, 0, 0]) + np.std([1, 1, 0, 1])) / 2
    )


def test_best_and_worst_match_their_closed_form():
    # One prompt, c of n samples correct; k draws with replacement: P(best = 1) = 1 - (1-p)^k,
    # P(worst = 1) = p^k with p = c / n. 1000 bootstraps: within 0.05 of it.
    m = validation_metrics(samples("gsm8k", [[1, 0, 0, 0, 0, 0, 0, 0]]))
    p = 1 / 8
    for k in (2, 4, 8):
        assert m[f"val-{'core' if k == 8 else 'aux'}/gsm8k/acc/best@{k}/mean"] == pytest.approx(
            1 - (1 - p) ** k, abs=0.05
        )
        assert m[f"val-aux/gsm8k/acc/worst@{k}/mean"] == pytest.approx(p**k, abs=0.05)


def test_all_correct_or_all_wrong_is_exact():
    m = validation_metrics(samples("gsm8k", [[1, 1, 1, 1], [0, 0, 0, 0]], [list("aaaa")] * 2))
    for name in ("best@4/mean", "maj@4/mean", "mean@4"):
        assert m[f"val-core/gsm8k/acc/{name}"] == 0.5
    assert m["val-core/gsm8k/acc/best@4/std"] == 0.0
    assert m["val-aux/gsm8k/acc/worst@2/mean"] == 0.5


def test_majority_takes_the_value_of_the_answer_most_samples_give():
    # 3 of 5 samples answer "12" (wrong), 2 answer "7" (right): majority of all 5 draws is
    # "12" most of the time, so maj@5 is well below mean@5 = 0.4.
    values = np.array([0.0, 0.0, 0.0, 1.0, 1.0])
    preds = ["12", "12", "12", "7", "7"]
    mean, _ = bootstrap_majority(values, preds, 5, np.random.default_rng(0))
    # P(at least 3 of 5 draws give "12") = 0.683; ties cannot happen with 5 draws and 2 answers
    assert mean == pytest.approx(1 - 0.683, abs=0.05)


def test_a_majority_tie_goes_to_the_answer_drawn_first():
    # Two answers, k = 2 draws: a tie (one each) goes to the first drawn, as in verl.
    values = np.array([1.0, 0.0])
    mean, _ = bootstrap_majority(values, ["a", "b"], 2, np.random.default_rng(0))
    assert mean == pytest.approx(0.5, abs=0.05)  # first draw decides: half the time "a"
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 2, size=(1000, 2))
    expected = values[idx[:, 0]].mean()  # same generator, same draws: exactly the first's value
    assert bootstrap_majority(values, ["a", "b"], 2, np.random.default_rng(3))[0] == expected


def test_no_majority_without_answers_and_missing_answers_vote_as_none():
    without = validation_metrics(samples("gsm8k", [[1, 0]]))
    assert not any("maj@" in k for k in without)
    some = [
        SampleResult("gsm8k", 0, {"acc": 0.0}, None),  # failed sample: no answer
        SampleResult("gsm8k", 0, {"acc": 0.0}, None),
        SampleResult("gsm8k", 0, {"acc": 1.0}, "3"),
    ]
    m = validation_metrics(some)
    assert "val-core/gsm8k/acc/maj@3/mean" in m
    assert m["val-core/gsm8k/acc/maj@3/mean"] < m["val-core/gsm8k/acc/mean@3"]


def test_data_sources_apart_and_the_same_outcomes_give_the_same_metrics():
    both = samples("a", [[1, 0], [1, 1]], [["x", "y"]] * 2) + samples("b", [[0, 0]], [["z", "z"]])
    m = validation_metrics(both, seed=5)
    assert m["val-core/a/acc/mean@2"] == 0.75 and m["val-core/b/acc/mean@2"] == 0.0
    assert validation_metrics(both, seed=5) == m


def test_a_data_source_without_an_accuracy_has_the_reward_as_its_core_variable():
    """verl's choice: a reward model alone reports no acc, so the core metric is the reward
    (before, an accuracy of "score >= 1" was made up for it: 0 for a reward model's logits)."""
    rm_only = [SampleResult("hh", p, {"reward": r}) for p, r in enumerate([0.3, -0.1])]
    m = validation_metrics([*rm_only, *samples("gsm8k", [[1.0], [0.0]])])
    assert m["val-core/hh/reward/mean@1"] == pytest.approx(0.1)
    assert not any(k.startswith("val-core/hh/acc") or "/hh/acc/" in k for k in m)
    assert m["val-core/gsm8k/acc/mean@1"] == 0.5  # a rule scorer's data_source: as before
    assert m["val-aux/gsm8k/reward/mean@1"] == 1.0


def test_a_sample_the_scorer_failed_counts_as_inaccurate():
    """A failed sample carries no acc extra; the data_source's other samples do."""
    m = validation_metrics(
        [
            SampleResult("gsm8k", 0, {"acc": 1.0, "reward": 1.0}),
            SampleResult("gsm8k", 1, {"reward": 0.0}),
        ]
    )
    assert m["val-core/gsm8k/acc/mean@1"] == 0.5


def test_gsm8ks_reward_is_core_as_verl_files_it_and_its_accuracy_stays():
    """verl's GSM8k scorer returns a bare float, so verl's dashboards read
    val-core/openai/gsm8k/reward/mean@1; meshrl's acc (the demo's held-out accuracy) stays."""
    from services.coordinator.run.validation import reward_core

    m = validation_metrics(
        samples("openai/gsm8k", [[1.0], [0.0], [1.0], [1.0]]), reward_is_core={"openai/gsm8k"}
    )
    assert m == {
        "val-core/openai/gsm8k/acc/mean@1": 0.75,
        "val-core/openai/gsm8k/reward/mean@1": 1.5,  # acc * 2 in these samples
    }
    n4 = validation_metrics(
        samples("openai/gsm8k", [[1, 0, 0, 1]]), reward_is_core={"openai/gsm8k"}
    )
    assert "val-core/openai/gsm8k/reward/best@4/mean" in n4
    assert "val-aux/openai/gsm8k/reward/std@4" in n4  # only mean, maj and best at n are core
    assert "openai/gsm8k" in reward_core(build_config({}))
    assert reward_core(build_config({}, ["reward.custom_function=f.py:fn"])) == frozenset()
