"""A multi-turn run through the mesh (rollout, actor, critic, reward and env servers, the
local launcher): three-turn arithmetic dialogues, where every turn is followed by the
environment's next question. What the trainer is sent is checked against what the engine
sampled and the environment said, token for token, and its loss mask against who wrote
each token."""

from __future__ import annotations

import math

import pytest

from meshrl.config import build_config
from meshrl.testing.char_tokenizer import PRINTABLE_CHARS, build_char_tokenizer
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl_app.demo.arithmetic_chain import write_arithmetic_chain_parquet
from meshrl_app.run_local import run_local
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.metrics.sinks import read_jsonl
from services.trainer.client import TrainerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) runs of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def test_the_trainer_sees_the_sampled_turns_and_the_observations(tmp_path, monkeypatch):
    model = make_tiny_model_dir(
        tmp_path / "model", chars=PRINTABLE_CHARS, hidden=32, intermediate=64
    )
    data = write_arithmetic_chain_parquet(tmp_path / "data", n_train=16, n_val=4)
    # context -> what the engine returned for it (n samples of a prompt share their first)
    sampled: dict[tuple[int, ...], list[list[int]]] = {}
    updates: list[tuple] = []
    generate, update_policy = RolloutPool.generate, TrainerClient.update_policy

    def recording_generate(self, prompts, sampling):
        out = generate(self, prompts, sampling)
        for ctx, ids in zip(prompts.tolist(), out.responses.tolist(), strict=True):
            sampled.setdefault(tuple(ctx), []).append(ids)
        return out

    def recording_update(self, prompts, responses, *args, loss_mask=None, **kwargs):
        updates.append((prompts.tolist(), responses.tolist(), loss_mask.tolist()))
        return update_policy(self, prompts, responses, *args, loss_mask=loss_mask, **kwargs)

    monkeypatch.setattr(RolloutPool, "generate", recording_generate)
    monkeypatch.setattr(TrainerClient, "update_policy", recording_update)
    cfg = build_config(
        {},
        [
            f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['test']}]",
            "data.train_batch_size=4",
            "data.max_prompt_length=16",
            "data.max_response_length=48",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.environment=arithmetic_chain",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_turn_tokens=10",
            "algorithm.adv_estimator=gae",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.plot=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    run_local(cfg)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["multi_turn/turns/mean"] > 1  # the dialogue went on past turn 1
    assert rows[-1]["multi_turn/observation_tokens/mean"] > 0
    assert math.isfinite(rows[-1]["actor/pg_loss"]) and math.isfinite(rows[-1]["critic/vf_loss"])
    val = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("step") == 2]
    assert any("val-core/openai/gsm8k/acc/mean@1" in r for r in val)

    tok = build_char_tokenizer(PRINTABLE_CHARS)
    assert len(updates) == 2
    checked_observations = 0
    for prompts, responses, masks in updates:
        for prompt, response, mask in zip(prompts, responses, masks, strict=True):
            assert len(mask) == len(response)
            for start, end, own in _segments(mask):
                if own:  # the model's: the prefix of what the engine sampled after it
                    outputs = sampled[tuple(prompt + response[:start])]
                    assert response[start:end] in [out[: end - start] for out in outputs]
                else:  # the environment's: its question, as the tokenizer writes it
                    text = tok.decode(response[start:end])
                    assert text.startswith(("\nRight. Now ", "\nWrong, it is "))
                    assert response[start:end] == tok.encode(text, add_special_tokens=False)
                    checked_observations += 1
    assert checked_observations > 0
