"""evaluate(): responses.jsonl joined with a parquet file by row index, scored in-process."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.cli import main as cli_main
from meshrl.config.schema import RewardConfig
from services.reward.evaluate import (
    SampleResult,
    evaluate,
    format_table,
    main,
    read_responses,
    summarize,
)

pytestmark = pytest.mark.timeout(120)


def row(source, gt, **extra):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": "q"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "test", "index": 0, **extra},
    }


@pytest.fixture
def files(tmp_path):
    rows = [
        row("openai/gsm8k", "72"),  # 0
        row("openai/gsm8k", "1234"),  # 1
        row("DigitalLearningGmbH/MATH-lighteval", "\\frac{1}{2}"),  # 2
        row("openai/gsm8k", "5"),  # 3: no response -> missing
    ]
    data = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    lines = [
        {"index": 0, "response": "... #### 72"},
        {"index": 1, "responses": ["#### 1,234", "#### 1235", "no answer"]},
        {"index": 2, "response": "so $\\boxed{0.5}$"},
        {"index": 2, "response": "so $\\boxed{0.25}$"},  # lines for one index add up
    ]
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return data, responses


def test_evaluate_in_process(files, tmp_path):
    data, responses = files
    out = tmp_path / "report.json"
    report = evaluate(data, responses, output=out, cfg=RewardConfig(num_workers=1))
    by = {s.data_source: s for s in report.sources}
    gsm = by["openai/gsm8k"]
    # responses: row 0 right; row 1: right, wrong, none -> 2/4 right; both prompts solved once.
    assert (gsm.prompts, gsm.responses, gsm.acc, gsm.pass_at_n, gsm.mean_score) == (
        2,
        4,
        0.5,
        1.0,
        0.5,
    )
    math = by["DigitalLearningGmbH/MATH-lighteval"]
    assert (math.prompts, math.responses, math.acc, math.pass_at_n) == (1, 2, 0.5, 1.0)
    assert report.overall.responses == 6 and report.overall.acc == pytest.approx(3 / 6)
    assert report.missing_rows == 1 and report.overall.failed == 0
    assert [(s.index, s.sample, s.score) for s in report.samples[:4]] == [
        (0, 0, 1.0),
        (1, 0, 1.0),
        (1, 1, 0.0),
        (1, 2, 0.0),
    ]
    saved = json.loads(out.read_text())
    assert saved["overall"]["acc"] == pytest.approx(0.5) and len(saved["samples"]) == 6
    table = format_table(report)
    assert table.splitlines()[0].split() == [
        "data_source",
        "prompts",
        "responses",
        "mean_score",
        "acc",
        "pass@n",
        "maj@n",
        "failed",
    ]
    # majority: row 1's three answers tie at one vote each, so the first ("1234", right) wins
    assert gsm.maj_at_n == 1.0 and math.maj_at_n == 1.0
    assert "openai/gsm8k" in table and table.splitlines()[-2].startswith("all")
    assert "(1 rows of the data had no response)" in table


def test_an_empty_responses_list_leaves_its_row_missing(files):
    data, responses = files
    with responses.open("a") as f:
        f.write(json.dumps({"index": 3, "responses": []}) + "\n")
    report = evaluate(data, responses, cfg=RewardConfig(num_workers=1))
    assert report.missing_rows == 1 and report.overall.responses == 6


def test_cli_main(files, tmp_path, capsys):
    data, responses = files
    assert main(["--data", str(data), "--responses", str(responses), "--num-workers", "1"]) == 0
    assert "openai/gsm8k" in capsys.readouterr().out


def test_meshrl_reward_eval_takes_the_modules_arguments(files, tmp_path, capsys):
    """`meshrl reward eval` is the same command: several files, a custom function, limits."""
    data, responses = files
    second = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist([row("openai/gsm8k", "9")]), second)
    with responses.open("a") as f:
        f.write(json.dumps({"index": 4, "response": "#### 9"}) + "\n")  # row 0 of the 2nd file
    scorer = tmp_path / "always_half.py"
    scorer.write_text(
        "def score(data_source, response, ground_truth, extra_info):\n    return 0.5\n"
    )
    argv = ["reward", "eval", "--data", str(data), str(second), "--responses", str(responses)]
    argv += ["--custom-function", f"{scorer}:score", "--timeout-s", "5", "--num-workers", "1"]
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    gsm = next(line.split() for line in table.splitlines() if line.startswith("openai/gsm8k"))
    assert gsm[1:4] == ["3", "5", "0.5000"]  # prompts, responses, mean_score: all scored 0.5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 1: expected"),
        ('{"response": "x"}', "line 1: expected"),
        ('{"index": 9, "response": "x"}', "index 9 is outside the data's 4 rows"),
        ('{"index": 0, "responses": [1]}', "responses must be strings"),
        # a bare string would be scored as one response per character
        ('{"index": 0, "responses": "#### 72"}', "responses must be a list of strings"),
        ('{"index": 0, "response": ["#### 72"]}', "response must be a string"),
        # true and 1.7 would silently score row 1
        ('{"index": true, "response": "x"}', "index must be an integer, got true"),
        ('{"index": 1.7, "response": "x"}', "index must be an integer, got 1.7"),
    ],
)
def test_bad_responses_file(tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        read_responses(path, 4)


def test_unknown_data_source_in_data(tmp_path):
    data = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([row("my/set", "1")]), data)
    (tmp_path / "r.jsonl").write_text('{"index": 0, "response": "1"}\n')
    with pytest.raises(ValueError, match="unknown data_source 'my/set'"):
        evaluate(data, tmp_path / "r.jsonl", cfg=RewardConfig(num_workers=1))


def test_majority_at_n_judges_the_answer_most_responses_give():
    def sample(index, k, pred, acc):
        return SampleResult(index, k, "gsm8k", acc, acc, True, "", pred)

    samples = [
        # prompt 0: "12" twice (wrong) beats "7" once (right): the majority is wrong
        sample(0, 0, "7", 1.0), sample(0, 1, "12", 0.0), sample(0, 2, "12", 0.0),
        # prompt 1: two responses without an answer ("none") beat one right answer
        sample(1, 0, "", 0.0), sample(1, 1, "", 0.0), sample(1, 2, "3", 1.0),
        # prompt 2: a tie goes to the answer given first
        sample(2, 0, "5", 1.0), sample(2, 1, "6", 0.0),
    ]  # fmt: skip
    report = summarize(samples)
    assert report.overall.maj_at_n == pytest.approx(1 / 3)
    assert report.overall.pass_at_n == 1.0
    no_answers = summarize([SampleResult(0, 0, "x", 1.0, 1.0, True)])  # e.g. a reward model
    assert no_answers.overall.maj_at_n is None
    assert format_table(no_answers).splitlines()[-1].split()[-2] == "-"
