"""evaluate(): responses.jsonl joined with a parquet file by row index, scored in-process."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.config.sections import RewardConfig, RewardModelConfig
from meshrl.testing.tiny_model import make_tiny_reward_model_dir
from meshrl_app.cli import main as cli_main
from services.reward.evaluate import (
    SampleResult,
    evaluate,
    format_table,
    main,
    read_responses,
    summarize,
)
from services.reward.scorers.registry import known_data_sources

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
        # one of the two would be scored and the other dropped without a word
        ('{"index": 0, "response": "a", "responses": ["b"]}', 'both "response" and "responses"'),
        ("", "r.jsonl holds no responses: one JSON object a line"),  # exit 0, all zeros before
        ('{"index": 0, "responses": []}', "r.jsonl holds no responses"),
    ],
)
def test_bad_responses_file(tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        read_responses(path, 4)


def test_a_responses_file_that_cannot_be_read_is_named(tmp_path):
    # Before: `[Errno 2] No such file or directory: 'nofile.jsonl'`, `[Errno 21] Is a
    # directory`, and for bad bytes `'utf-8' codec can't decode byte 0xff` without file or line
    with pytest.raises(ValueError, match=r"responses file .*nofile.jsonl: No such file"):
        read_responses(tmp_path / "nofile.jsonl", 4)
    with pytest.raises(ValueError, match=r"responses file .*: Is a directory"):
        read_responses(tmp_path, 4)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"index": 0, "response": "x"}\n\xff\xfe{"index": 1}\n')
    with pytest.raises(ValueError, match=r"b.jsonl line 2: not UTF-8 text \(invalid start byte"):
        read_responses(binary, 4)


def test_a_custom_function_that_cannot_be_loaded_is_a_bad_argument(files, tmp_path, capsys):
    # Before: exit 1, as for a failed scoring; `meshrl reward serve` and `meshrl run` say 2
    fn = tmp_path / "ok.py"
    fn.write_text(
        "def compute_score(data_source, response, ground_truth, extra_info):\n    return 1\n"
    )
    assert cli_main(eval_argv(files, "--custom-function", f"{fn}:nope", "--num-workers", "1")) == 2
    err = capsys.readouterr().err
    assert "error: reward.custom_function: " in err and "has no function 'nope'" in err


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


WRONG_SIGNATURE = "def compute_score(solution_str, ground_truth):\n    return 1.0\n"
"""A reward function of the wrong shape: every sample fails with its TypeError."""

FAILS_ON_GSM8K = """
def score(data_source, response, ground_truth, extra_info):
    if data_source == "openai/gsm8k" and "1234" in ground_truth:
        raise RuntimeError("cannot score this one")
    return 1.0
"""


def eval_argv(files, *extra):
    data, responses = files
    return ["reward", "eval", "--data", str(data), "--responses", str(responses), *extra]


def test_every_sample_failing_names_the_reason_and_exits_1(files, tmp_path, capsys):
    """Before: `failed 6` in the table and exit 0; the reason only in the --output JSON."""
    fn = tmp_path / "wrong.py"
    fn.write_text(WRONG_SIGNATURE)
    argv = eval_argv(files, "--custom-function", f"{fn}:compute_score", "--num-workers", "1")
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-2].split()[-1] == "6"  # the table still comes, on stdout
    reason = "TypeError: compute_score() takes 2 positional arguments but 4 were given"
    assert err.splitlines() == [
        f"DigitalLearningGmbH/MATH-lighteval: 2 of 2 samples could not be scored (first: {reason})",
        f"openai/gsm8k: 4 of 4 samples could not be scored (first: {reason})",
    ]


def test_some_samples_failing_are_named_and_exit_0(files, tmp_path, capsys):
    fn = tmp_path / "some.py"
    fn.write_text(FAILS_ON_GSM8K)
    argv = eval_argv(files, "--custom-function", f"{fn}:score", "--num-workers", "1")
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "openai/gsm8k: 3 of 4 samples could not be scored "
        "(first: RuntimeError: cannot score this one)"
    ]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--custom-function", "raises.py"], "--custom-function"),
        (["--num-workers", "4"], "--num-workers"),
        (
            ["--custom-function", "raises.py", "--num-workers", "4"],
            "--custom-function and --num-workers",
        ),
        (
            ["--reward-model", "/", "--reward-model-weight", "2.0"],
            "--reward-model and --reward-model-weight",
        ),
    ],
)
def test_in_process_flags_are_refused_with_server(files, capsys, flags, named):
    """Before: --custom-function was silently ignored, the server's scores reported."""
    # refused before any connection: no server listens there
    assert cli_main(eval_argv(files, "--server", "127.0.0.1:1", *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named} cannot be used with --server: ")
    assert f"(meshrl reward serve {' '.join(flags)})" in err


def test_the_timeout_goes_with_server(files, capsys):
    # not refused: it is sent with each call (the dead server is what fails here)
    assert cli_main(eval_argv(files, "--server", "127.0.0.1:1", "--timeout-s", "5")) == 1
    assert "error: reward server 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--timeout-s", "0", "argument --timeout-s: must be more than 0, got 0"),
        ("--timeout-s", "-1", "argument --timeout-s: must be more than 0, got -1"),
        ("--num-workers", "0", "argument --num-workers: must be at least 1, got 0"),
        ("--num-workers", "1.5", "argument --num-workers: must be a whole number, got '1.5'"),
    ],
)
def test_limits_that_are_not_positive_are_one_line(files, capsys, flag, value, message):
    """Before: a pydantic ValidationError traceback."""
    with pytest.raises(SystemExit) as e:
        cli_main(eval_argv(files, flag, value))
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"meshrl reward eval: error: {message}"


def model_row(source, prompt):
    """A row scored by a reward model alone (verl's style "model", no ground truth)."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "chat",
        "reward_model": {"style": "model", "ground_truth": ""},
        "extra_info": {"split": "test", "index": 0},
    }


def test_a_data_source_for_a_reward_model_in_process_says_how_to_score_it(tmp_path, capsys):
    """Before: `unknown data_source 'Dahoas/full-hh-rlhf'; known: ...` and no hint."""
    data = tmp_path / "hh.parquet"
    pq.write_table(pa.Table.from_pylist([model_row("Dahoas/full-hh-rlhf", "Q: hi")]), data)
    responses = tmp_path / "r.jsonl"
    responses.write_text('{"index": 0, "response": "hello"}\n')
    argv = ["reward", "eval", "--data", str(data), "--responses", str(responses)]
    assert cli_main([*argv, "--num-workers", "1"]) == 1
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith("error: unknown data_source 'Dahoas/full-hh-rlhf'; known: ")
    assert error.endswith(
        'Rows of a data_source with no rule scorer (reward_model.style "model") are scored by '
        "a reward model: pass `--reward-model DIR` to load one in this process, or `--server "
        "HOST:PORT` of a `meshrl reward serve --reward-model DIR` (or score every row with "
        "`--custom-function FILE.py:NAME`)"
    )


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    return make_tiny_reward_model_dir(tmp_path_factory.mktemp("rm"))


def test_a_reward_model_alone_has_no_accuracy(tmp_path, tiny_rm):
    """Before: `acc` and `pass@n` of "score >= 1" for a reward model's logits (0.0000 here,
    whose logits are small), as if every response were wrong. Now `-`, with the mean score;
    the `all` line's acc is over the data_sources that are judged."""
    rows = [row("openai/gsm8k", "72"), model_row("Dahoas/full-hh-rlhf", "Q: 1+2=")]
    data = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    lines = [
        {"index": 0, "responses": ["#### 72", "#### 71"]},
        {"index": 1, "responses": ["3", "33"]},
    ]
    responses = tmp_path / "r.jsonl"
    responses.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = RewardConfig(
        num_workers=1, reward_model=RewardModelConfig(enable=True, path=str(tiny_rm))
    )
    out = tmp_path / "report.json"
    report = evaluate(data, responses, output=out, cfg=cfg)
    by = {s.data_source: s for s in report.sources}
    hh, gsm = by["Dahoas/full-hh-rlhf"], by["openai/gsm8k"]
    assert (hh.acc, hh.pass_at_n, hh.maj_at_n) == (None, None, None)
    rm_scores = [s.score for s in report.samples if s.data_source == "Dahoas/full-hh-rlhf"]
    assert hh.mean_score == pytest.approx(sum(rm_scores) / 2) and hh.mean_score != 0.0
    assert (gsm.acc, gsm.pass_at_n, gsm.maj_at_n) == (0.5, 1.0, 1.0)  # the rule's verdicts
    assert (report.overall.acc, report.overall.pass_at_n) == (0.5, 1.0)  # gsm8k's only
    assert report.overall.responses == 4
    table = format_table(report).splitlines()
    assert table[0].split()[3] == "mean_score"
    hh_line = next(line.split() for line in table if line.startswith("Dahoas/full-hh-rlhf"))
    assert hh_line[1:] == ["1", "2", f"{hh.mean_score:.4f}", "-", "-", "-", "0"]
    all_line = next(line.split() for line in table if line.startswith("all"))
    assert all_line[4:7] == ["0.5000", "1.0000", "1.0000"]
    saved = json.loads(out.read_text())
    assert [s["acc"] for s in saved["samples"]] == [1.0, 0.0, None, None]
    assert saved["sources"][0]["acc"] is None and saved["sources"][0]["pass_at_n"] is None


def test_a_data_source_whose_samples_all_failed_still_counts_them_wrong():
    """No verdict and no score: `acc` 0 as before (not `-`), since the scorer judges."""
    report = summarize([SampleResult(0, 0, "gsm8k", 0.0, 0.0, False, "TypeError: x")])
    assert (report.overall.acc, report.overall.pass_at_n) == (0.0, 0.0)


def test_meshrl_reward_eval_loads_a_reward_model_in_process(tmp_path, tiny_rm, capsys):
    """Before: `unrecognized arguments: --reward-model`; a reward model's rows could be
    scored only through a server started for them."""
    rows = [row("openai/gsm8k", "72"), model_row("Dahoas/full-hh-rlhf", "Q: 1+2=")]
    data = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    responses = tmp_path / "r.jsonl"
    responses.write_text('{"index": 0, "response": "#### 72"}\n{"index": 1, "response": "3"}\n')
    argv = ["reward", "eval", "--data", str(data), "--responses", str(responses)]
    argv += ["--num-workers", "1", "--reward-model", str(tiny_rm)]
    reports = {}
    for weight in ("1", "-2"):
        out = tmp_path / f"report_{weight}.json"
        assert cli_main([*argv, "--reward-model-weight", weight, "--output", str(out)]) == 0
        reports[weight] = {s["data_source"]: s for s in json.loads(out.read_text())["samples"]}
    capsys.readouterr()
    # the same scores as the API with the same reward model
    cfg = RewardConfig(
        num_workers=1, reward_model=RewardModelConfig(enable=True, path=str(tiny_rm))
    )
    api = {s.data_source: s for s in evaluate(data, responses, cfg=cfg).samples}
    model_score = api["Dahoas/full-hh-rlhf"].score
    assert model_score != 0.0
    assert reports["1"]["Dahoas/full-hh-rlhf"]["score"] == pytest.approx(model_score)
    assert reports["-2"]["Dahoas/full-hh-rlhf"]["score"] == pytest.approx(-2 * model_score)
    # gsm8k: the rule's 1 plus the weighted model score of its pair; its verdict the rule's
    gsm = {w: reports[w]["openai/gsm8k"] for w in reports}
    assert gsm["1"]["acc"] == gsm["-2"]["acc"] == 1.0
    rm_part = gsm["1"]["score"] - 1.0
    assert gsm["-2"]["score"] == pytest.approx(1.0 - 2 * rm_part)


def test_reward_model_flags_in_process_that_are_wrong_are_one_line_and_exit_2(
    files, tmp_path, capsys
):
    assert cli_main(eval_argv(files, "--reward-model-weight", "2")) == 2
    assert capsys.readouterr().err == "error: --reward-model-weight needs --reward-model DIR\n"
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    assert cli_main(eval_argv(files, "--num-workers", "1", "--reward-model", str(not_a_model))) == 2
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith("error: --reward-model: ") and str(not_a_model) in error


def test_an_unknown_data_source_is_left_unscored_and_the_rest_scored(tmp_path, capsys):
    """Before, one unknown data_source failed the whole evaluation (exit 1, no table)."""
    data = tmp_path / "d.parquet"
    rows = [row("openai/gsm8k", "72"), row("my/own", "1"), row("my/own", "2")]
    pq.write_table(pa.Table.from_pylist(rows), data)
    responses = tmp_path / "r.jsonl"
    lines = [{"index": 0, "response": "#### 72"}, {"index": 1, "responses": ["1", "one"]}]
    lines.append({"index": 2, "response": "2"})
    responses.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = tmp_path / "report.json"
    argv = ["reward", "eval", "--data", str(data), "--responses", str(responses)]
    assert cli_main([*argv, "--num-workers", "1", "--output", str(report)]) == 0
    out, err = capsys.readouterr()
    assert "openai/gsm8k" in out and "(3 responses not scored: my/own 3)" in out
    assert err.splitlines() == [
        "warning: data_source 'my/own': 3 responses not scored, no reward scorer knows it "
        f"(known: {', '.join(known_data_sources())}); --strict makes this an error"
    ]
    saved = json.loads(report.read_text())
    assert saved["unscored"] == {"my/own": 3} and saved["overall"]["responses"] == 1
    assert saved["overall"]["acc"] == 1.0
    # --strict: the whole evaluation fails on it, as before
    assert cli_main([*argv, "--num-workers", "1", "--strict"]) == 1
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith("error: unknown data_source 'my/own'; known: openai/gsm8k, ")


def _samples(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_samples_file_is_scored_without_a_parquet_file(tmp_path, capsys):
    samples = _samples(
        tmp_path / "s.jsonl",
        [
            {"data_source": "openai/gsm8k", "response": "#### 72", "ground_truth": "72"},
            # two responses to one prompt (index 7): pass@n and maj@n group them
            {"data_source": "gsm8k", "response": "#### 5", "ground_truth": "6", "index": 7},
            {"data_source": "gsm8k", "responses": ["#### 6"], "ground_truth": 6, "index": 7},
            {
                "data_source": "Rowan/hellaswag",
                "response": "(B)",
                "ground_truth": "1",
                "extra_info": {"endings": ["a", "b", "c", "d"]},
            },
        ],
    )
    report = tmp_path / "report.json"
    argv = ["reward", "eval", "--samples", str(samples), "--num-workers", "1"]
    assert cli_main([*argv, "--output", str(report)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(report.read_text())
    by = {s["data_source"]: s for s in saved["sources"]}
    assert (by["openai/gsm8k"]["acc"], by["Rowan/hellaswag"]["acc"]) == (1.0, 1.0)
    assert (by["gsm8k"]["prompts"], by["gsm8k"]["responses"], by["gsm8k"]["acc"]) == (1, 2, 0.5)
    assert by["gsm8k"]["pass_at_n"] == 1.0
    # each sample of the report carries its response and ground truth
    assert [
        (s["index"], s["sample"], s["response"], s["ground_truth"]) for s in saved["samples"]
    ] == [
        (0, 0, "#### 72", "72"),
        (7, 0, "#### 5", "6"),
        (7, 1, "#### 6", "6"),  # a number as ground truth is read as the loader reads it
        (3, 0, "(B)", "1"),  # without an index, a row's position in the file
    ]
    assert saved["missing_rows"] == 0 and "all" in out


def test_a_parquet_samples_file_is_scored_too(tmp_path):
    from services.reward.evaluate import evaluate_samples

    path = tmp_path / "s.parquet"
    rows = [{"data_source": "openai/gsm8k", "response": "#### 3", "ground_truth": "3"}] * 2
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = evaluate_samples(path, cfg=RewardConfig(num_workers=1))
    assert (report.overall.prompts, report.overall.responses, report.overall.acc) == (2, 2, 1.0)
    (tmp_path / "bad.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"samples file .*bad.parquet is not a readable parquet"):
        evaluate_samples(tmp_path / "bad.parquet", cfg=RewardConfig(num_workers=1))
    pq.write_table(
        pa.Table.from_pylist([{"data_source": "x", "answer": "1"}]), tmp_path / "b.parquet"
    )
    with pytest.raises(ValueError, match=r"b.parquet has no column 'response'; columns present: "):
        evaluate_samples(tmp_path / "b.parquet", cfg=RewardConfig(num_workers=1))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"data_source": "gsm8k", "response": "x"}',
            r"s.jsonl line 1: expected \{\"data_source\"",
        ),
        ("[1, 2]", r"s.jsonl line 1: expected \{\"data_source\""),
        ("{nope", r"s.jsonl line 1: expected .* \(not JSON: "),
        (
            '{"data_source": 3, "response": "x", "ground_truth": "1"}',
            "data_source must be a string",
        ),
        ('{"data_source": "gsm8k", "response": "x", "ground_truth": [1]}', "ground_truth must be"),
        (
            '{"data_source": "gsm8k", "response": 5, "ground_truth": "1"}',
            "response must be a string",
        ),
        (
            '{"data_source": "gsm8k", "response": "x", "ground_truth": "1", "index": "a"}',
            "index must",
        ),
        (
            '{"data_source": "gsm8k", "response": "x", "ground_truth": "1", "extra_info": 1}',
            "extra_info",
        ),
        ("", r"samples file .*s.jsonl holds no rows"),
    ],
)
def test_a_bad_samples_file_is_named_with_its_line(tmp_path, line, message):
    from services.reward.eval_inputs import samples_input

    path = tmp_path / "s.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        samples_input([path])


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--samples", "s.jsonl", "--data", "d.parquet"], "--samples cannot be used with --data"),
        (["--data", "d.parquet"], "--data needs --responses FILE"),
        (["--responses", "r.jsonl"], "--responses needs --data FILE..."),
        ([], "nothing to score: give --data FILE... with --responses FILE, or --samples"),
    ],
)
def test_inputs_that_do_not_go_together_are_one_line_and_exit_2(capsys, flags, says):
    assert cli_main(["reward", "eval", *flags]) == 2
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith(f"error: {says}")


def test_slow_scorers_are_not_waited_for_in_silence(files, tmp_path, capsys, monkeypatch):
    """Every PROGRESS_EVERY_S (10 s; 0.2 s here) a line on stderr says what the eval waits
    for; before, `meshrl reward eval` was silent for 79 s with slow scorers."""
    from meshrl import progress_ticker

    monkeypatch.setattr(progress_ticker, "PROGRESS_EVERY_S", 0.2)
    data, responses = files
    slow = tmp_path / "slow.py"
    slow.write_text(
        "import time\n\ndef score(data_source, response, ground_truth, extra_info):\n"
        "    time.sleep(0.4)\n    return 1.0\n"
    )
    argv = ["reward", "eval", "--data", str(data), "--responses", str(responses)]
    argv += ["--custom-function", f"{slow}:score", "--timeout-s", "5", "--num-workers", "1"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "reward eval: scoring in process: " in err and " responses (" in err, err
