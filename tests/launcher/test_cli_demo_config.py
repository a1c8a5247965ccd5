"""`meshrl demo --config` reads its file as `meshrl run` does: a missing file or one that is
not a mapping is a bad request (exit 2) with the same one-line message, not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrl_app import cli
from meshrl_app.demo.run import demo_config

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bad_configs(tmp_path):
    """Before: FileNotFoundError and AttributeError tracebacks from `meshrl demo`."""
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- actor_rollout_ref.rollout.n=4\n")
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("trainer: {total_training_steps: 3\n")
    return {"missing": tmp_path / "nope.yaml", "a list": a_list, "not YAML": not_yaml}


@pytest.mark.parametrize("which", ["missing", "a list", "not YAML"])
def test_demo_refuses_a_bad_config_file_as_meshrl_run_does(tmp_path, capsys, bad_configs, which):
    path = str(bad_configs[which])
    assert cli.main(["run", path]) == cli.EXIT_BAD_REQUEST
    run_err = capsys.readouterr().err
    out = tmp_path / "demo_out"
    assert cli.main(["demo", "--out", str(out), "--config", path]) == cli.EXIT_BAD_REQUEST == 2
    demo_err = capsys.readouterr().err
    assert demo_err == run_err and demo_err.startswith(f"meshrl: config file {path} ")
    assert "Traceback" not in demo_err
    assert not out.exists()  # refused before any work


def test_the_demo_config_and_an_example_get_the_demos_paths(tmp_path):
    own = demo_config(tmp_path, ["trainer.total_training_steps=3"])
    example = demo_config(tmp_path, [], str(REPO / "examples/grpo_n4.yaml"))
    for cfg in (own, example):
        assert cfg.data.train_files == [str(tmp_path / "data/train.parquet")]
        assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
    assert own.trainer.total_training_steps == 3
    assert example.actor_rollout_ref.rollout.n == 4


@pytest.mark.slow
def test_the_demo_says_what_it_does_from_its_first_second(tmp_path):
    """Its first line comes before torch and transformers are imported; before, `meshrl
    demo` printed nothing for its first 16 s on a loaded machine."""
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "meshrl_app.cli", "demo", "--out", str(tmp_path / "d"),
           "--config", str(tmp_path / "nope.yaml")]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_s = time.monotonic() - start
    _, err = proc.communicate(timeout=120)
    assert first == "demo: loading torch and transformers\n"
    assert first_s < 5, first_s  # the import of torch alone takes longer
    assert proc.returncode == 2 and "nope.yaml does not exist" in err
