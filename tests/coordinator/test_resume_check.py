"""A resume compared with the config its checkpoint was saved under: refused where the saved
state no longer fits, warned about otherwise. Before, any config resumed silently: another
estimator, a 1000x learning rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import meshrl_app.run_local as run_local_module
from meshrl.config import ConfigError, build_config, config_to_yaml
from meshrl_app import cli
from services.coordinator.recovery.checkpointing import CheckpointManager, CoordinatorState
from services.coordinator.recovery.resume_check import check_resume_config

BASE = ["actor_rollout_ref.model.path=/m/base", "algorithm.adv_estimator=gae"]


def checkpoint_of(tmp_path: Path, overrides: list[str], shape: dict | None = None) -> Path:
    """A checkpoint folder as far as the check reads it: its config.yaml, its hf/config.json."""
    folder = tmp_path / "checkpoints" / "global_step_4"
    (folder / "hf").mkdir(parents=True)
    (folder / "config.yaml").write_text(config_to_yaml(build_config({}, overrides)))
    (folder / "hf" / "config.json").write_text(json.dumps(shape or llama(64)))
    return folder


def llama(hidden: int) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128,
            "vocab_size": 22}  # fmt: skip


def resume(checkpoint: Path, overrides: list[str]) -> str | None:
    return check_resume_config(build_config({}, overrides), checkpoint)


def test_the_same_config_and_changes_of_no_trained_state_say_nothing(tmp_path):
    checkpoint = checkpoint_of(tmp_path, BASE)
    assert resume(checkpoint, BASE) is None
    unrelated = [
        "trainer.total_training_steps=100", "trainer.save_freq=5", "trainer.logger=[console]",
        "actor_rollout_ref.actor.world_size=2", "critic.ppo_micro_batch_size_per_gpu=2",
        "launcher.max_restarts=0", "trainer.experiment_name=other", "data.val_files=[v.parquet]",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
    ]  # fmt: skip
    assert resume(checkpoint, [*BASE, *unrelated]) is None


def test_another_estimator_is_refused_naming_each_change_and_the_ways_out(tmp_path):
    checkpoint = checkpoint_of(tmp_path, BASE)
    with pytest.raises(ConfigError) as refused:
        resume(checkpoint, [*BASE, "algorithm.adv_estimator=grpo"])
    assert str(refused.value) == (
        f"trainer.resume_mode=auto: the checkpoint {checkpoint} was saved under another "
        "config, which its state does not fit: critic.enable true → false (a critic), "
        "algorithm.adv_estimator gae → grpo; train in another trainer.default_local_dir, start "
        "over with trainer.resume_mode=disable, or resume anyway with "
        "trainer.resume_allow_config_changes=true"
    )


def test_a_learning_rate_moved_more_than_10x_is_refused_within_10x_warned(tmp_path):
    checkpoint = checkpoint_of(tmp_path, [*BASE, "actor_rollout_ref.actor.optim.lr=1e-6"])
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref.actor.optim.lr 1e-06 → 0.001 \(1000x\)"
    ):
        resume(checkpoint, [*BASE, "actor_rollout_ref.actor.optim.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"optim.lr 1e-06 → 1e-08 \(100x\)"):  # down too
        resume(checkpoint, [*BASE, "actor_rollout_ref.actor.optim.lr=1e-8"])
    warned = resume(
        checkpoint,
        [*BASE, "actor_rollout_ref.actor.optim.lr=5e-6", "actor_rollout_ref.actor.clip_ratio=0.3"],
    )
    assert warned == (
        f"resuming from {checkpoint} with a changed config: "
        "actor_rollout_ref.actor.clip_ratio 0.2 → 0.3, actor_rollout_ref.actor.optim.lr 1e-06 → 5e-06"
    )


def test_the_explicit_key_resumes_anyway_listing_every_change(tmp_path):
    checkpoint = checkpoint_of(tmp_path, [*BASE, "actor_rollout_ref.actor.optim.lr=1e-6"])
    allowed = [
        *BASE[:1], "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.resume_allow_config_changes=true",
    ]  # fmt: skip
    warned = resume(checkpoint, allowed)
    assert warned is not None and warned.startswith(f"resuming from {checkpoint} with a changed")
    for change in ("critic.enable true → false", "algorithm.adv_estimator gae → grpo",
                   "actor_rollout_ref.actor.optim.lr 1e-06 → 0.001 (1000x)"):  # fmt: skip
        assert change in warned


def test_lora_settings_and_a_model_of_other_shapes_are_refused_a_moved_one_warned(tmp_path):
    checkpoint = checkpoint_of(tmp_path, BASE)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.lora_rank 0 → 8"):
        resume(checkpoint, [*BASE, "actor_rollout_ref.model.lora_rank=8"])
    for name, hidden in (("moved", 64), ("bigger", 128)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(llama(hidden)))
    moved = f"actor_rollout_ref.model.path={tmp_path / 'moved'}"
    warned = resume(checkpoint, [moved, *BASE[1:]])
    assert warned is not None
    assert (
        f"actor_rollout_ref.model.path /m/base → {tmp_path / 'moved'} (the same shapes)" in warned
    )
    bigger = f"actor_rollout_ref.model.path={tmp_path / 'bigger'}"
    with pytest.raises(ConfigError, match=r"\(another model: hidden_size 64 → 128\)"):
        resume(checkpoint, [bigger, *BASE[1:]])


def test_a_checkpoint_without_a_config_to_compare_is_resumed_as_before(tmp_path):
    checkpoint = checkpoint_of(tmp_path, BASE)
    (checkpoint / "config.yaml").write_text("")
    assert resume(checkpoint, [*BASE, "algorithm.adv_estimator=grpo"]) is None


class _NoLauncher:
    started: list = []

    def __init__(self, cfg, run_dir):
        pass

    def start(self):
        self.started.append(True)
        raise AssertionError("no role server should start")

    def stop(self):
        pass


def test_meshrl_run_refuses_a_changed_estimator_before_any_server_starts(
    monkeypatch, tmp_path, capsys, caplog
):
    """Through `meshrl run`: one line, exit 2; a change within bounds is a warning and the
    run goes on to start its servers."""
    from meshrl.testing.tiny_model import make_tiny_model_dir
    from meshrl_app.demo.arithmetic import write_arithmetic_parquet

    model = make_tiny_model_dir(tmp_path / "model", hidden=32, intermediate=64)
    data = write_arithmetic_parquet(tmp_path / "data", n_train=16, n_val=8)
    run_dir = tmp_path / "run"
    line = [
        f"data.train_files={data['train']}", f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8", "trainer.total_training_steps=4",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]",
    ]  # fmt: skip
    loader = {"epoch": 0, "batch_in_epoch": 2, "seed": 1}
    state = CoordinatorState.capture(2, loader, {"type": "fixed", "value": 0.001}, 2)
    saved = config_to_yaml(build_config({}, line))
    CheckpointManager(run_dir).save(2, state, saved, lambda tmp: (tmp / "actor").mkdir())
    monkeypatch.setattr(run_local_module, "make_launcher", _NoLauncher)
    capsys.readouterr()  # the model's writing

    assert cli.main(["run", *line, "algorithm.adv_estimator=rloo"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"meshrl: trainer.resume_mode=auto: the checkpoint {run_dir}/checkpoints/global_step_2 "
        "was saved under another config, which its state does not fit: critic.enable true → "
        "false (a critic), algorithm.adv_estimator gae → rloo; train in another "
        "trainer.default_local_dir, start over with trainer.resume_mode=disable, or resume "
        "anyway with trainer.resume_allow_config_changes=true"
    ]
    assert _NoLauncher.started == []

    with caplog.at_level("WARNING"), pytest.raises(AssertionError, match="no role server"):
        cli.main(["run", *line, "actor_rollout_ref.actor.clip_ratio=0.25"])
    assert "with a changed config: actor_rollout_ref.actor.clip_ratio 0.2 → 0.25" in caplog.text
