"""`meshrl run CONFIG [key=value ...] --print-config` (Hydra's `--cfg job`): the resolved
config as YAML on standard output, exit 0, nothing started; a bad config is still one
message and exit 2."""

import io

import pytest
import yaml

from meshrl.config import load_config
from meshrl_app import cli


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    import meshrl_app.run_local as run_local

    def refuse(cfg, run_dir):
        raise AssertionError("role servers started to print a config")

    monkeypatch.setattr(run_local, "make_launcher", refuse)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {train_batch_size: 32}\n"
        "trainer: {project_name: p, experiment_name: e}\n"
        "actor_rollout_ref: {actor: {ppo_mini_batch_size: 16}}\n"
    )
    return path


def printed(capsys, argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return yaml.safe_load(out)


def test_prints_the_file_the_overrides_the_defaults_and_verls_translations(config, capsys):
    tree = printed(
        capsys,
        [
            "run",
            str(config),
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "trainer.n_gpus_per_node=1",  # verl's key: asks for a GPU, then dropped
            "--print-config",
        ],
    )
    assert tree["data"]["train_batch_size"] == 32  # the file
    assert tree["actor_rollout_ref"]["actor"]["clip_ratio"] == 0.3  # an override
    assert tree["data"]["max_prompt_length"] == 512  # a default
    assert tree["trainer"]["device"] == "cuda"  # verl's n_gpus_per_node=1, translated
    assert "n_gpus_per_node" not in tree["trainer"]
    assert tree["actor_rollout_ref"]["model"]["dtype"] == "bfloat16"  # filled in by device
    assert tree["critic"]["ppo_mini_batch_size"] == 16  # the actor's, as verl interpolates
    assert tree["trainer"]["default_local_dir"] == "runs/p/e"  # ${...} resolved


def test_the_printed_config_runs_as_the_original(config, capsys, tmp_path):
    overrides = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]
    tree = printed(capsys, ["run", str(config), *overrides, "--print-config"])
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(yaml.safe_dump(tree))
    assert load_config(resolved) == load_config(config, overrides)


def test_hydras_cfg_job_prints_the_same(config, capsys):
    assert printed(capsys, ["run", str(config), "--cfg", "job"]) == printed(
        capsys, ["run", str(config), "--print-config"]
    )


def test_launcher_flags_are_part_of_the_printed_config(config, capsys):
    tree = printed(capsys, ["run", str(config), "--launcher", "external", "--print-config"])
    assert tree["launcher"]["kind"] == "external"


def test_a_config_on_standard_input(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("data: {max_prompt_length: 77}\n"))
    assert printed(capsys, ["run", "-", "--print-config"])["data"]["max_prompt_length"] == 77


def test_a_bad_config_is_one_message_and_exit_2_with_nothing_printed(config, capsys):
    assert cli.main(["run", str(config), "data.train_batch_sise=8", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "data.train_batch_sise: unknown config key; did you mean data.train_batch_size?" in err
    assert "Traceback" not in err


def test_hydras_cfg_hydra_is_refused_naming_the_choices(config, capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["run", str(config), "--cfg", "hydra"])
    assert ended.value.code == 2
    assert "argument --cfg: invalid choice: 'hydra'" in capsys.readouterr().err
