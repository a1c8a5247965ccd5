"""Output folders a user names that cannot take the output (a file of that name, a folder
under /proc where nothing can be made; a read-only mount alike): one line naming the option
and exit 2, before any work. Before, `meshrl demo --out` and `meshrl preprocess --output`
ended in a FileNotFoundError / NotADirectoryError traceback (exit 1), `meshrl export --to`
after reading the whole checkpoint."""

from __future__ import annotations

import pytest

from meshrl.output_paths import output_problem
from meshrl_app import cli


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["demo", "--out", "/proc/nope"], "meshrl: --out /proc/nope: cannot write the output "
         "there: nothing can be written in /proc (No such file or directory)"),
        (["demo", "--out", "{file}"], "meshrl: --out {file}: cannot write the output there: a "
         "file of that name exists"),
        (["preprocess", "gsm8k", "--input", "{tmp}", "--output", "/proc/x"],
         "meshrl: --output /proc/x: cannot write the output there: nothing can be written in "
         "/proc"),
        (["export", "{tmp}", "--to", "{file}/sub"], "meshrl: --to {file}/sub: cannot write the "
         "output there: {file} is a file, not a folder"),
    ],
    ids=["demo_proc", "demo_file", "preprocess_proc", "export_under_a_file"],
)  # fmt: skip
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(argv, said, tmp_path, capsys):
    file = tmp_path / "afile"
    file.write_text("x")
    argv = [a.format(file=file, tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(said.format(file=file)), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_reward_eval_refuses_a_report_path_it_cannot_write(tmp_path, capsys):
    argv = ["reward", "eval", "--samples", str(tmp_path / "s.jsonl")]
    assert cli.main([*argv, "--output", "/proc/x/r.json"]) == 2
    assert (
        "error: --output /proc/x/r.json: cannot write the report there" in capsys.readouterr().err
    )
    assert cli.main([*argv, "--output", str(tmp_path)]) == 2
    assert "a folder of that name exists" in capsys.readouterr().err


def test_output_problem(tmp_path):
    assert output_problem(tmp_path) is None
    assert output_problem(tmp_path / "new" / "deeper") is None  # made later, under tmp_path
    (tmp_path / "f").write_text("")
    assert output_problem(tmp_path / "f") == "a file of that name exists"
    assert output_problem(tmp_path / "f" / "x") == f"{tmp_path / 'f'} is a file, not a folder"
