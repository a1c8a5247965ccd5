"""Checkpoints a user can take away: export to a Hugging Face folder whose log-probs (and
values) equal the trainer's, and resume on a different number of trainer ranks."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.local import LocalLauncher
from meshrl.ragged import Ragged
from meshrl_app.run_local import run_local
from services.coordinator.metrics.sinks import read_jsonl
from services.coordinator.recovery.checkpointing import CheckpointManager
from services.trainer.client import TrainerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _overrides(tiny_model, data, run_dir, steps, world_size):
    return [
        f"data.train_files=[{data['train']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=16",
        "data.max_response_length=10",
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.actor.world_size={world_size}",
        f"critic.world_size={world_size}",
        "critic.ppo_mini_batch_size=4",
        "algorithm.lam=0.95",
        "critic.optim.lr=1e-2",
        # a random model scores 0: the KL penalty gives the critic non-zero returns to learn
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.5",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.plot=false",
        f"trainer.default_local_dir={run_dir}",
    ]


def _hf_logprobs(model, prompts: Ragged, responses: Ragged) -> torch.Tensor:
    out = []
    for p, r in zip(prompts.tolist(), responses.tolist(), strict=True):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return torch.cat(out)


@contextmanager
def _servers(tiny_model, data, tmp_path, world_size: int):
    """Role servers whose actor and critic have ``world_size`` ranks, and the `launcher`
    config that points a run at them: the runs on each rank count take turns on one set
    (trainer ranks cost ~11 s of CPU each to start on the 2-core machine)."""
    cfg = build_config({}, _overrides(tiny_model, data, tmp_path / "unused", 1, world_size))
    with LocalLauncher(cfg, tmp_path / f"servers_{world_size}") as launcher:
        e = launcher.start()
        addresses = dict(rollout=e.rollout, actor=[e.actor], critic=[e.critic], ref=[e.ref])
        yield e, {"kind": "external", "addresses": {**addresses, "reward": [e.reward]}}


def test_resume_on_other_rank_counts_then_export(tiny_model, arithmetic_data, tmp_path):
    with (
        _servers(tiny_model, arithmetic_data, tmp_path, 2) as (_, on_two),
        _servers(tiny_model, arithmetic_data, tmp_path, 1) as (one, on_one),
    ):
        _resume_on_other_rank_counts_then_export(
            tiny_model, arithmetic_data, tmp_path, {1: on_one, 2: on_two}, one
        )


def _resume_on_other_rank_counts_then_export(tiny_model, arithmetic_data, tmp_path, on, one):
    run_dir = tmp_path / "run"
    # saved with 2 ranks, resumed with 1, then saved with 1 and resumed with 2
    for steps, ws in ((1, 2), (2, 1), (3, 2)):
        overrides = _overrides(tiny_model, arithmetic_data, run_dir, steps, ws)
        run_local(build_config({"launcher": on[ws]}, overrides))
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert steps == [1, 2, 3]
    ckpt = CheckpointManager(run_dir).latest_valid()
    assert ckpt.name == "global_step_3"

    actor_dir, critic_dir = tmp_path / "hf_actor", tmp_path / "hf_critic"
    for role, dest in (("actor", actor_dir), ("critic", critic_dir)):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshrl_app.cli",
                "export",
                str(ckpt),
                "--role",
                role,
                "--to",
                str(dest),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
    assert (actor_dir / "tokenizer.json").is_file() and (
        actor_dir / "generation_config.json"
    ).is_file()

    prompts = Ragged.from_lists(
        [[1, 20, 21, 19, 6, 7, 14, 9, 12, 17], [1, 20, 21, 19, 5, 5, 14, 5, 17]]
    )
    responses = Ragged.from_lists([[6, 9, 14, 9, 12, 17, 8, 5], [5, 5, 14, 2]])
    # the 1-rank servers, with the checkpoint loaded
    cfg = build_config({}, _overrides(tiny_model, arithmetic_data, tmp_path / "check", 1, 1))
    actor = TrainerClient(one.actor, 120, "actor")
    critic = TrainerClient(one.critic, 120, "critic")
    for client, role in ((actor, "actor"), (critic, "critic")):
        client.initialize(config_to_yaml(cfg))
        client.load_checkpoint(str(ckpt / role))
    trainer_lp, _ = actor.compute_log_probs(prompts, responses, 1.0)
    trainer_values = critic.compute_values(prompts, responses)

    exported = AutoModelForCausalLM.from_pretrained(actor_dir)
    with torch.no_grad():
        hf_lp = _hf_logprobs(exported, prompts, responses)
    assert torch.allclose(hf_lp, trainer_lp.values, atol=1e-5), (
        (hf_lp - trainer_lp.values).abs().max()
    )

    value_model = AutoModelForTokenClassification.from_pretrained(critic_dir)
    with torch.no_grad():
        hf_values = torch.cat(
            [
                value_model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1, 0]
                for p, r in zip(prompts.tolist(), responses.tolist(), strict=True)
            ]
        )
    assert torch.allclose(hf_values, trainer_values.values, atol=1e-5)
    assert trainer_values.values.abs().max() > 0, "the critic trained: values are not all zero"
