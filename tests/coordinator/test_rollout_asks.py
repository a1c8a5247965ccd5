"""What a PPO step asks of the rollout engine, by config: the sampled tokens' log-probs
(``rollout.calculate_log_probs``, ``rollout.probs_diff_freq``) and a seed per prompt
(``rollout.seed_per_prompt``), down to the keywords vLLM's ``SamplingParams`` gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshrl.config import ConfigError, build_config
from meshrl.ragged import Ragged
from services.coordinator.step.ppo_step import PPOStep
from services.rollout.convert import sampling_from_proto, sampling_to_proto
from services.rollout.vllm.mapping import per_prompt_kwargs

STEPS = range(1, 23)
ROLLOUT = "actor_rollout_ref.rollout."


def asks(*overrides: str):
    """The SamplingParams of steps 1..22 under ``overrides``."""
    cfg = build_config({}, list(overrides))
    step = SimpleNamespace(cfg=cfg)
    return cfg, [PPOStep.sampling_params(step, k) for k in STEPS]  # type: ignore[arg-type]


def logprob_steps(params) -> list[int]:
    return [k for k, p in zip(STEPS, params, strict=True) if p.logprobs]


def test_native_and_fast_engines_keep_log_probs_and_seeds_on_every_step():
    """`make demo`'s run as before: every step seeded, its log-probs used every step."""
    for name in ("auto", "native", "fast"):
        _, params = asks(f"{ROLLOUT}name={name}")
        assert logprob_steps(params) == list(STEPS)
        assert all(p.seed is not None for p in params)
        assert len({p.seed for p in params}) == len(params)


def test_vllm_by_default_asks_for_log_probs_every_tenth_step_and_no_seed():
    cfg, params = asks(f"{ROLLOUT}name=vllm", "trainer.device=cuda")
    assert logprob_steps(params) == [1, 11, 21]  # the drift metric's steps
    assert all(p.seed is None for p in params)
    # what vLLM is asked: no log-prob, no seed on step 2; the sampled token's on step 1
    step2 = per_prompt_kwargs(params[1], 3)
    assert all(k["logprobs"] is None and "seed" not in k for k in step2)
    assert {k["logprobs"] for k in per_prompt_kwargs(params[0], 3)} == {0}


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        ([f"{ROLLOUT}probs_diff_freq=3"], [1, 4, 7, 10, 13, 16, 19, 22]),
        ([f"{ROLLOUT}probs_diff_freq=1"], list(STEPS)),
        ([f"{ROLLOUT}probs_diff_freq=0"], []),
        ([f"{ROLLOUT}calculate_log_probs=true"], list(STEPS)),
        ([f"{ROLLOUT}calculate_log_probs=false"], []),
        # truncated IS weighs every token by its rollout log-prob: every step
        (["actor_rollout_ref.actor.tis_imp_ratio_cap=2"], list(STEPS)),
        # fully async: decoupled PPO's behaviour weight (the cap's default there is 2)
        (["trainer.async_training.enable=true"], list(STEPS)),
    ],
)
def test_log_probs_are_asked_for_on_the_steps_that_use_them(overrides, steps):
    _, params = asks(f"{ROLLOUT}name=vllm", "trainer.device=cuda", *overrides)
    assert logprob_steps(params) == steps
    _, native = asks(*overrides)  # set, the keys mean the same on the native engine
    assert logprob_steps(native) == steps


def test_no_log_probs_with_a_cap_that_needs_them_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        build_config(
            {},
            [f"{ROLLOUT}calculate_log_probs=false", "actor_rollout_ref.actor.tis_imp_ratio_cap=2"],
        )
    assert (
        "actor_rollout_ref.rollout.calculate_log_probs=false does not go with "
        "actor.tis_imp_ratio_cap=2 (truncated IS and decoupled PPO weigh each token by its "
        "rollout log-prob; async training sets the cap)" in str(refused.value)
    )
    with pytest.raises(ConfigError, match="calculate_log_probs=false does not go with"):
        build_config(
            {}, [f"{ROLLOUT}calculate_log_probs=false", "trainer.async_training.enable=true"]
        )


def test_seed_per_prompt_either_way_on_either_engine():
    _, seeded = asks(f"{ROLLOUT}name=vllm", "trainer.device=cuda", f"{ROLLOUT}seed_per_prompt=true")
    assert all(p.seed is not None for p in seeded)
    seeds = [k["seed"] for k in per_prompt_kwargs(seeded[0], 3)]
    assert len(set(seeds)) == 3  # vLLM gets a seed per prompt
    _, unseeded = asks(f"{ROLLOUT}seed_per_prompt=false")
    assert all(p.seed is None for p in unseeded)


def test_the_ask_crosses_the_wire():
    _, params = asks(f"{ROLLOUT}name=vllm", "trainer.device=cuda")
    assert sampling_from_proto(sampling_to_proto(params[1])) == params[1]
    assert not sampling_to_proto(params[0]).skip_logprobs  # an older server reads it as before
    assert sampling_to_proto(params[1]).skip_logprobs


def test_the_actor_gets_rollout_log_probs_only_on_the_steps_that_asked_for_them():
    cfg = build_config({}, [f"{ROLLOUT}name=vllm", "trainer.device=cuda"])
    got = []
    actor = SimpleNamespace(update_policy=lambda *a, **kw: got.append(kw["rollout_logprobs"]))
    step = SimpleNamespace(cfg=cfg, roles=SimpleNamespace(actor=actor))
    rows = Ragged.from_lists([[0.0, 0.0]])
    generated = SimpleNamespace(
        prompts=rows, responses=rows, loss_mask=None,
        rollout_logprobs=rows.with_values(torch.full((2,), float("nan"))),
    )  # fmt: skip
    inferred = SimpleNamespace(old_logprobs=rows, ref_logprobs=None)
    trajectory = SimpleNamespace(advantages=rows)
    for k in (1, 2):
        PPOStep.update_actor(step, generated, inferred, trajectory, k)  # type: ignore[arg-type]
    assert got[0] is generated.rollout_logprobs and got[1] is None
