"""Worker pool: a scorer that raises, hangs, dies, or returns a non-number costs its sample
only, and the pool keeps working. Custom functions from a file."""

import multiprocessing
import threading
import time

import pytest

from meshrl.config.sections import RewardConfig
from services.reward.convert import outcome_from_proto, outcome_to_proto
from services.reward.pool import ScorerPool
from services.reward.scorer_process import BadScore, coerce
from services.reward.scoring import ANY_SOURCE, RewardScorer
from services.reward.types import ScoreItem, ScoreOutcome

pytestmark = pytest.mark.timeout(120)

CUSTOM = '''
import os, time

def misbehave(data_source, solution_str, ground_truth, extra_info):
    """Does what the response says."""
    if solution_str == "raise":
        raise ValueError("bad input")
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "hang_and_tell":  # ground_truth: a file to make once hanging
        open(ground_truth, "w").close()
        time.sleep(600)
    if solution_str == "str":
        return "1.0"
    if solution_str == "nan":
        return float("nan")
    if solution_str == "die":
        os._exit(3)
    if solution_str == "hog":
        return len(bytearray(2 * 1024**3))
    if solution_str == "dict":
        return {"score": 0.5, "acc": 1, "note": "not a number, dropped"}
    if solution_str == "nodict":
        return {"acc": 1}
    return 1.0 if solution_str == ground_truth else 0.0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(data_source))
'''


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


@pytest.fixture(scope="module")
def scorer(custom_file):
    cfg = RewardConfig(custom_function=f"{custom_file}:misbehave", timeout_s=1.0, num_workers=2)
    with RewardScorer(cfg, memory_limit_mb=1024) as s:
        yield s


def item(response, gt="7", source="any/thing"):
    return ScoreItem(data_source=source, response=response, ground_truth=gt)


@pytest.mark.slow
def test_each_failure_costs_its_sample_only(scorer):
    kinds = ["7", "raise", "hang", "str", "nan", "die", "hog", "dict", "nodict", "8"]
    t0 = time.monotonic()
    out = scorer.score([item(k) for k in kinds])
    assert time.monotonic() - t0 < 10  # the hang costs its timeout, not the batch
    by = dict(zip(kinds, out, strict=True))
    assert (by["7"].score, by["7"].ok) == (1.0, True)
    assert (by["8"].score, by["8"].ok) == (0.0, True)
    assert by["raise"].reason == "ValueError: bad input"
    assert by["hang"].reason == "timeout after 1.0s"
    assert by["str"].reason == "returned str, expected a number"
    assert by["nan"].reason == "returned nan, expected a finite number"
    assert by["die"].reason.startswith("worker died")
    assert by["hog"].reason.startswith("MemoryError")
    assert by["nodict"].reason.startswith("returned a dict without 'score'")
    for k in ["raise", "hang", "str", "nan", "die", "hog", "nodict"]:
        assert (by[k].score, by[k].ok) == (0.0, False), k
    assert by["dict"].ok and by["dict"].score == 0.5
    assert by["dict"].extra == {"acc": 1.0, "rule_score": 0.5}
    # the pool still works afterwards
    again = scorer.score([item("7"), item("7")])
    assert [o.score for o in again] == [1.0, 1.0]


def test_custom_function_overrides_every_data_source(scorer):
    assert ANY_SOURCE in scorer.known_data_sources()
    out = scorer.score([item("7", source="openai/gsm8k"), item("7", source="never/heard")])
    assert [o.score for o in out] == [1.0, 1.0]


def test_custom_function_default_name(custom_file):
    with RewardScorer(RewardConfig(custom_function=str(custom_file), num_workers=1)) as s:
        assert s.score([item("x", source="abc")])[0].score == 3.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/missing.py:fn", "does not exist"),
        ("{file}:nope", "has no function 'nope'; callables there: misbehave, compute_score"),
    ],
)
def test_bad_custom_function_fails_at_start(custom_file, spec, message):
    spec = spec.format(dir=custom_file.parent, file=custom_file)
    with pytest.raises(ValueError, match=message):
        RewardScorer(RewardConfig(custom_function=spec, num_workers=1))


@pytest.mark.slow
def test_pathological_math_finishes_within_timeout():
    towers = [
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{9^{999999999}}",  # a power computed in C: only killing the worker ends it
        "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
    ]
    items = [ScoreItem("lighteval/MATH", r, "5") for r in towers]
    with RewardScorer(RewardConfig(timeout_s=2.0, num_workers=2)) as s:
        t0 = time.monotonic()
        out = s.score(items + [ScoreItem("math", "\\boxed{5}", "5")])
        # Each sample ends at its 2 s timeout at the latest; the wall time adds the start of
        # replacement workers (a second or more on a loaded 2-core machine).
        assert time.monotonic() - t0 < 20
        assert [o.score for o in out] == [0.0, 0.0, 0.0, 1.0]
        assert out[1].reason == "timeout after 2.0s"
        assert s.score([ScoreItem("math", "\\boxed{\\frac{1}{2}}", "0.5")])[0].score == 1.0


def test_unknown_data_source_is_rejected_before_any_work():
    pool_calls = []
    with RewardScorer(RewardConfig(num_workers=1)) as s:
        s.pool.submit = lambda *a, **k: pool_calls.append(a)  # must not be reached
        with pytest.raises(ValueError, match="unknown data_source 'x/y'; known: openai/gsm8k"):
            s.score([ScoreItem("openai/gsm8k", "#### 1", "1"), ScoreItem("x/y", "1", "1")])
    assert not pool_calls


def test_rule_scores_carry_acc_and_rule_score():
    with RewardScorer(RewardConfig(num_workers=1)) as s:
        out = s.score([ScoreItem("gsm8k", "#### 3", "3"), ScoreItem("gsm8k", "#### 4", "3")])
    assert out[0].extra == {"rule_score": 1.0, "acc": 1.0}
    assert out[1].extra == {"rule_score": 0.0, "acc": 0.0}


def test_the_gsm8k_method_of_the_config_reaches_the_workers():
    """verl's strict by default; reward.gsm8k_method=lenient reads `####18` and `#### $18`
    too, and the answer it reads (pred, for majority votes) is the one it judged."""
    items = [ScoreItem("openai/gsm8k", "####18", "18"), ScoreItem("gsm8k", "#### $7.", "7")]
    with RewardScorer(RewardConfig(num_workers=1)) as s:
        assert [(o.score, o.pred) for o in s.score(items)] == [(0.0, ""), (0.0, "")]
    with RewardScorer(RewardConfig(num_workers=1, gsm8k_method="lenient")) as s:
        assert [(o.score, o.pred) for o in s.score(items)] == [(1.0, "18"), (1.0, "7")]


def test_pool_directly_and_empty_batch():
    pool = ScorerPool(num_workers=1)
    try:
        assert pool.score([], 1.0) == []
        out = pool.score([ScoreItem("openai/gsm8k", "#### 1,000", "1000")], 5.0)
        assert out[0].ok and out[0].score == 1.0
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, (1.0, {}, None)),
        (True, (1.0, {}, None)),
        (0.5, (0.5, {}, None)),
        ({"score": 2, "x": 1.5}, (2.0, {"x": 1.5}, None)),
        # an extra that is no finite number is dropped: a NaN "acc" made every mean NaN
        ({"score": 1, "acc": float("nan"), "n": float("inf"), "ok": 1}, (1.0, {"ok": 1.0}, None)),
        # verl's "pred" (the extracted answer) is kept as text, not as an extra
        ({"score": 1, "acc": 1, "pred": "42"}, (1.0, {"acc": 1.0}, "42")),
        ({"score": 0, "pred": 7}, (0.0, {}, "7")),
        ({"score": 0, "pred": None}, (0.0, {}, None)),
    ],
)
def test_coerce(value, expected):
    out = coerce(value)
    assert (out.score, out.extra, out.pred) == expected


def test_rule_scorers_give_the_answer_they_judged():
    with RewardScorer(RewardConfig(num_workers=1)) as s:
        out = s.score(
            [
                ScoreItem("openai/gsm8k", "so #### 1,000", "1000"),
                ScoreItem("openai/gsm8k", "no number here", "3"),
                ScoreItem("lighteval/MATH", "it is \\boxed{ \\frac{1}{2} }", "0.5"),
                ScoreItem("hellaswag", "Answer: C", "2", extra_info={"endings": list("wxyz")}),
            ]
        )
    assert [o.pred for o in out] == ["1000", "", "\\frac{1}{2}", "2"]
    assert [o.score for o in out] == [1.0, 0.0, 1.0, 1.0]


def test_a_custom_functions_pred_reaches_the_client(tmp_path):
    module = tmp_path / "votes.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'pred': solution_str.strip()}\n"
    )
    with RewardScorer(RewardConfig(num_workers=1, custom_function=f"{module}:compute_score")) as s:
        (out,) = s.score([ScoreItem("anything", " 12 ", "12")])
    assert out.pred == "12"
    assert outcome_from_proto(outcome_to_proto(out)).pred == "12"
    assert outcome_from_proto(outcome_to_proto(ScoreOutcome(0.0))).pred is None  # unset


@pytest.mark.parametrize("value", [None, "1", [1], float("inf"), {"score": "1"}])
def test_coerce_rejects(value):
    with pytest.raises(BadScore):
        coerce(value)


def test_a_stopped_pool_is_replaced():
    pool = ScorerPool(num_workers=1)
    try:
        pool._pool.stop()  # as if every worker had died: pebble refuses new tasks
        out = pool.score([ScoreItem("gsm8k", "#### 1", "1")], 5.0)
        assert out[0].ok and out[0].score == 1.0
    finally:
        pool.close()


UNRULY = """
import sys

class TwoArgs(Exception):  # unpicklable: its __init__ wants two arguments
    def __init__(self, a, b):
        super().__init__(f"{a} and {b} disagree")

def unruly(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "own":
        raise TwoArgs("gold", "prediction")
    if solution_str == "exit":
        sys.exit(2)
    if solution_str == "interrupt":
        raise KeyboardInterrupt
    return 1.0
"""


def test_any_exception_of_a_custom_function_costs_its_sample_only(tmp_path):
    # The user's own exception classes live in a module workers load by path, so they do not
    # pickle back; SystemExit and KeyboardInterrupt are not Exceptions. Each must become that
    # sample's reason, not a PicklingError, nor end the caller (a server thread, or the
    # in-process evaluation).
    path = tmp_path / "unruly.py"
    path.write_text(UNRULY)
    cfg = RewardConfig(custom_function=f"{path}:unruly", timeout_s=5.0, num_workers=1)
    with RewardScorer(cfg) as s:
        out = s.score([item(k) for k in ["own", "exit", "interrupt", "7"]])
    assert [o.reason for o in out] == [
        "TwoArgs: gold and prediction disagree",
        "SystemExit: 2",
        "KeyboardInterrupt: ",
        "",
    ]
    assert [(o.score, o.ok) for o in out] == [(0.0, False)] * 3 + [(1.0, True)]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("import sys\nsys.exit('no GPU here')\n", "SystemExit: no GPU here"),
        # a ValueError of the user's module, named as such and not passed off as our message
        ("int('')\n", "ValueError: invalid literal for int"),
    ],
)
def test_custom_module_failing_at_import_fails_at_start(tmp_path, body, reason):
    path = tmp_path / "fails.py"
    path.write_text(body)
    with pytest.raises(ValueError, match=f"fails.py:compute_score: {reason}"):
        RewardScorer(RewardConfig(custom_function=f"{path}:compute_score", num_workers=1))


def test_custom_module_defining_a_dataclass_loads(tmp_path):
    # dataclasses (and pickle) look the defining module up in sys.modules; a module loaded by
    # path but left out of it failed at import with "'NoneType' object has no attribute
    # '__dict__'".
    path = tmp_path / "with_dataclass.py"
    path.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass Verdict:\n    score: float\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return Verdict(float(solution_str == ground_truth)).score\n"
    )
    with RewardScorer(RewardConfig(custom_function=str(path), num_workers=1)) as s:
        assert [o.score for o in s.score([item("7"), item("8")])] == [1.0, 0.0]


def _wait_for_file(path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def test_abandon_cancels_the_samples_of_a_hung_scorer_and_ends_its_workers(custom_file):
    """What a stopping server does: the call returns at once instead of after the timeout."""
    cfg = RewardConfig(custom_function=f"{custom_file}:misbehave", timeout_s=60.0, num_workers=1)
    others = set(multiprocessing.active_children())  # other tests' scorers
    scorer = RewardScorer(cfg)
    workers = [p for p in multiprocessing.active_children() if p not in others]
    assert workers, "the scorer worker runs in a child process"
    outcomes: list[ScoreOutcome] = []
    told = custom_file.parent / "abandon_hanging"
    hung = [item("hang_and_tell", gt=str(told)), item("hang"), item("7")]
    call = threading.Thread(target=lambda: outcomes.extend(scorer.score(hung)))
    call.start()
    _wait_for_file(told)  # the worker has taken the first sample and hangs in it
    t0 = time.monotonic()
    scorer.abandon()
    call.join(10)
    assert not call.is_alive() and time.monotonic() - t0 < 10
    # the sample being scored and the two queued behind it
    assert [(o.ok, o.reason) for o in outcomes] == [
        (False, "cancelled: its caller left or the server is stopping")
    ] * 3
    late = scorer.score([item("7")])  # a call that comes after is cancelled too, at once
    assert not late[0].ok and "cancelled" in late[0].reason
    deadline = time.monotonic() + 10
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(w.is_alive() for w in workers)


def test_a_caller_that_leaves_takes_its_samples_out_of_the_workers(custom_file):
    """The server registers the cancel with its RPC: a call past its deadline no longer
    holds the workers while later calls' samples wait (here 2 x 60 s on one worker)."""
    cfg = RewardConfig(custom_function=f"{custom_file}:misbehave", timeout_s=60.0, num_workers=1)
    with RewardScorer(cfg) as scorer:
        leave: list = []
        outcomes: list[ScoreOutcome] = []
        told = custom_file.parent / "leaver_hanging"
        hung = [item("hang_and_tell", gt=str(told)), item("hang")]
        call = threading.Thread(
            target=lambda: outcomes.extend(scorer.score(hung, when_caller_leaves=leave.append))
        )
        call.start()
        _wait_for_file(told)  # the worker hangs in the first sample
        t0 = time.monotonic()
        leave[0]()  # the caller's RPC ended
        call.join(10)
        assert not call.is_alive()
        assert [o.reason for o in outcomes] == [
            "cancelled: its caller left or the server is stopping"
        ] * 2
        later = scorer.score([item("7")])  # the next call gets a (fresh) worker at once
        assert later[0].ok and later[0].score == 1.0
        assert time.monotonic() - t0 < 30
