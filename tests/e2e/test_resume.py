"""Checkpoints through the mesh: save at step k, resume, and step k+1 is the step an
uninterrupted run makes (same data order, same metrics); old checkpoints are pruned."""

from __future__ import annotations

import pytest

from meshrl.config import build_config
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cfg(tiny_model, data, run_dir, steps, extra=(), launcher=None):
    """``launcher``: a `launcher` section (``shared_mesh``'s), else the local launcher."""
    return build_config(
        {"launcher": launcher} if launcher else {},
        [
            f"data.train_files=[{data['train']}]",
            "data.train_batch_size=8",
            "data.max_prompt_length=16",
            "data.max_response_length=10",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "critic.ppo_mini_batch_size=4",
            "algorithm.lam=0.95",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.05",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=2",
            "trainer.plot=false",
            f"trainer.default_local_dir={run_dir}",
            *extra,
        ],
    )


def _steps(run_dir):
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r}


@pytest.fixture(scope="module")
def straight(tiny_model, arithmetic_data, tmp_path_factory, shared_mesh):
    """The folder of a 3-step run with no break, a checkpoint each step (the 2 newest kept),
    run on the shared servers (so its folder has no logs/ of servers of its own)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run_local(_cfg(tiny_model, arithmetic_data, run_dir, 3, launcher=shared_mesh))
    return run_dir


def test_resume_continues_exactly(tiny_model, arithmetic_data, straight, tmp_path, shared_mesh):
    """On the same servers as the straight run, which other runs initialize in between: a
    server that kept anything of an earlier run would show here as a step that differs."""
    resumed = tmp_path / "resumed"
    run_local(_cfg(tiny_model, arithmetic_data, resumed, 2, launcher=shared_mesh))
    # only the 2 newest checkpoints are kept, each complete and verified
    assert [p.name for p in CheckpointManager(straight).complete()] == [
        "global_step_2",
        "global_step_3",
    ]
    run_local(_cfg(tiny_model, arithmetic_data, resumed, 3, launcher=shared_mesh))

    a, b = _steps(straight), _steps(resumed)
    assert sorted(b) == [1, 2, 3], "the resumed run logs step 3 after steps 1-2, nothing repeated"
    for key in [
        "critic/score/mean",
        "response_length/mean",
        "prompt_length/mean",
        "actor/pg_loss",
        "critic/vf_loss",
        "actor/reward_kl_penalty_coeff",
    ]:
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-6), key


def test_val_only_evaluates_a_checkpoint_without_training_files(
    tiny_model, arithmetic_data, straight, tmp_path
):
    # An evaluation in a folder of its own, of another run's step 2, with no data.train_files
    # at all: validation only, logged at step 2, nothing trained or saved, the run finished.
    evaluation = tmp_path / "evaluation"
    checkpoint = straight / "checkpoints" / "global_step_2"
    evaluate = [
        "data.train_files=[]",  # overrides _cfg's: a later override of a key wins
        f"data.val_files=[{arithmetic_data['test']}]",
        "trainer.val_only=true",
        f"trainer.resume_mode={checkpoint}",
    ]
    cfg = _cfg(tiny_model, arithmetic_data, evaluation, 3, evaluate)
    assert cfg.data.train_files == [] and cfg.trainer.val_only
    result = run_local(cfg)
    assert result.finished
    rows = read_jsonl(evaluation / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2]
    accuracy = [k for k in rows[0] if k.startswith("val-core/") and "/acc/mean@" in k]
    assert accuracy and all(0.0 <= rows[0][k] <= 1.0 for k in accuracy), rows[0]
    assert not any(k.startswith(("actor/", "critic/")) for k in rows[0]), "nothing trained"
    logs = evaluation / "logs"  # the servers started: no critic or reference, which load a
    assert (logs / "actor.log").exists()  # model and serve nothing in an evaluation
    assert not (logs / "critic.log").exists() and not (logs / "ref.log").exists()
    assert not (evaluation / "checkpoints").exists() or not any(
        (evaluation / "checkpoints").iterdir()
    ), "an evaluation saves no checkpoint"
    assert [p.name for p in CheckpointManager(straight).complete()] == [
        "global_step_2",
        "global_step_3",
    ], "the evaluated run's checkpoints are as they were"


def test_a_finished_run_run_again_trains_nothing_and_starts_no_server(
    tiny_model, arithmetic_data, straight
):
    """Its real last checkpoint (step 3 of 3) says it is done, before any server starts."""
    logged = (straight / "metrics.jsonl").read_text()
    config_written = (straight / "config.yaml").stat().st_mtime_ns
    assert not (straight / "logs").exists()  # it trained on the shared servers
    result = run_local(_cfg(tiny_model, arithmetic_data, straight, 3))  # the local launcher
    assert result.finished and dict(result) == {}
    # the config.yaml of the start that trained the run stays
    assert (straight / "config.yaml").stat().st_mtime_ns == config_written
    assert (straight / "metrics.jsonl").read_text() == logged, "no step, no validation logged"
    assert not (straight / "logs").exists(), "no server was started (none wrote its log)"
    assert [p.name for p in CheckpointManager(straight).complete()] == [
        "global_step_2",
        "global_step_3",
    ]
