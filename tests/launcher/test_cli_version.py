"""`meshrl --version`: meshrl's, torch's and grpcio's versions on one line of standard
output, exit 0, whatever else the command line says."""

import importlib.metadata

import pytest

from meshrl_app import cli


def test_version_is_one_line_naming_meshrl_torch_and_grpcio(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["--version"])
    assert ended.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"meshrl {importlib.metadata.version('meshrl')} (")
    assert f"torch {importlib.metadata.version('torch')}" in line
    assert f"grpcio {importlib.metadata.version('grpcio')}" in line


def test_version_wins_over_a_missing_command(capsys):
    # `meshrl --version` without a command is complete: no "the following arguments are
    # required: command".
    with pytest.raises(SystemExit) as ended:
        cli.main(["--version", "run"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.startswith("meshrl ")


def test_an_uninstalled_package_reads_unknown():
    from meshrl.version import package_version

    assert package_version("meshrl-no-such-package") == "unknown"
