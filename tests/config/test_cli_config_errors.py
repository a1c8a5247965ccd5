"""`meshrl run` with a config no run can use: exit code 2 and the key named, before any role
server starts."""

import pytest

from meshrl_app import cli


@pytest.fixture
def no_launch(monkeypatch):
    import meshrl_app.run_local as run_local

    def refuse(cfg, run_dir):
        raise AssertionError("role servers started for a config that cannot run")

    monkeypatch.setattr(run_local, "make_launcher", refuse)


def test_gae_without_a_critic_exits_2_naming_the_keys(tmp_path, capsys, no_launch):
    config = tmp_path / "run.yaml"
    config.write_text("algorithm: {adv_estimator: gae}\n")
    assert cli.main(["run", str(config), "critic.enable=false"]) == 2
    err = capsys.readouterr().err
    assert "critic.enable=false" in err and "adv_estimator=gae" in err


def test_unknown_key_exits_2(tmp_path, capsys, no_launch):
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    assert cli.main(["run", str(config), "trainer.total_epoch=3"]) == 2
    assert "trainer.total_epoch: unknown config key" in capsys.readouterr().err
