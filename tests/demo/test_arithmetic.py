"""The demo's data set and warm start: held-out problems never trained on, and a warm
start that stops where it is told."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic import (
    distinct_problems,
    operand_range,
    parse_prompt,
    prompt_text,
    read_problems,
    write_arithmetic_parquet,
)
from meshrl_app.demo.warm_start import greedy_accuracy, warm_start


@pytest.mark.parametrize("digits", [2, 3])
def test_validation_problems_are_never_training_ones(tmp_path, digits):
    paths = write_arithmetic_parquet(tmp_path, n_train=500, n_val=50, digits=digits)
    train, val = read_problems(paths["train"]), read_problems(paths["test"])
    assert (len(train), len(val)) == (500, 50)  # distinct within each split too
    assert not train & val
    lo, hi = operand_range(digits)
    assert all(lo <= x <= hi for pair in train | val for x in pair)


def test_the_two_digit_set_keeps_its_order():
    # the order the tests' data sets were drawn in before `digits` existed
    every = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(every)
    assert distinct_problems(20, random.Random(0)) == every[:20]


def test_a_prompt_reads_back():
    assert parse_prompt(prompt_text(123, 45)) == (123, 45)
    assert operand_range(1) == (0, 9) and operand_range(3) == (100, 999)


def test_more_problems_than_exist_is_refused():
    with pytest.raises(ValueError, match="only 100 of 1 digits exist"):
        distinct_problems(101, random.Random(0), digits=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("m"), seed=0, hidden=32, intermediate=64)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_the_warm_start_stops_at_the_first_check_that_reaches_the_accuracy(tiny):
    tokenizer, model = tiny
    torch.set_num_threads(1)
    # any accuracy reaches 0: it stops at the first check
    done = warm_start(
        model, tokenizer, max_iterations=50, stop_at_accuracy=0.0, check_every=3, probe_size=8
    )
    assert done.iterations == 3 and len(done.losses) == 1 and done.probe_accuracy is not None
    # an accuracy a random model cannot reach: every iteration runs
    done = warm_start(
        model, tokenizer, max_iterations=4, stop_at_accuracy=1.1, check_every=2, probe_size=8
    )
    assert done.iterations == 4 and len(done.losses) == 2


def test_greedy_accuracy_scores_the_gsm8k_answer_line(tiny):
    tokenizer, model = tiny
    # a random model writes no `#### n` line
    assert greedy_accuracy(model, tokenizer, [(12, 34), (56, 78)], max_new_tokens=4) == 0.0


def test_the_warm_start_says_how_it_goes_while_it_lasts(tiny, monkeypatch):
    """Before, it printed nothing until it ended: 725 s of silence on a loaded machine."""
    from meshrl import progress_ticker

    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 0.005)  # 10 s in the demo
    tokenizer, model = tiny
    lines: list[str] = []
    warm_start(
        model,
        tokenizer,
        max_iterations=6,
        stop_at_accuracy=1.1,
        check_every=2,
        probe_size=8,
        report=lines.append,
    )
    assert lines and all(line.startswith("warm start: iteration ") for line in lines)
    checked = [line for line in lines if "; at iteration " in line]
    assert checked, "the last check's loss and accuracy, once there is one"
    assert " of at most 6; at iteration " in checked[-1]
    assert "greedy accuracy on training problems 0.00 (stops at 1.10)" in checked[-1]
