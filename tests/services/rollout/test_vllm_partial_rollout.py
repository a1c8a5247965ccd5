"""Partial rollouts on the vLLM engine without vLLM: a stand-in for ``LLM.llm_engine`` (one
token a request a step, read as deltas) whose tokens and log-probs tell the weights that
made them. A swap aborts the unfinished requests before it lands, and each continues from
its prompt plus its tokens so far, for the tokens it has left, under the new weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshrl.ragged import Ragged
from services.rollout.engine import WeightsMixedError
from services.rollout.types import SamplingParams
from services.rollout.vllm import mapping
from services.rollout.vllm.engine import VllmEngine

pytestmark = pytest.mark.timeout(60)

STOP = 99
DELTA = "delta"


class _StandInEngineCore:
    """``llm_engine`` of a stand-in ``vllm.LLM``: each step, every running request gets one
    token, ``10 * weights + its position in the response`` (so each token says the weights
    and the place it was sampled at), with log-prob ``-(weights + 1) / 10``. ``stops``: the
    request ids (by their prompt's first token) that sample STOP at their 3rd token."""

    def __init__(self, stops=()):
        self.weights = 0
        self.running: dict[str, dict] = {}
        self.log: list[tuple] = []  # ("add", id, prompt, max_tokens, seed) | ("abort", ids)
        self.stops = set(stops)

    def add_request(self, request_id, prompt, params):
        assert params.output_kind == DELTA and params.n == 1
        ids = prompt["prompt_token_ids"]
        self.running[request_id] = {"prompt": ids, "params": params, "made": 0}
        self.log.append(("add", request_id, list(ids), params.max_tokens, vars(params).get("seed")))

    def abort_request(self, request_ids, internal=False):
        self.log.append(("abort", sorted(request_ids)))
        for r in request_ids:
            self.running.pop(r, None)

    def step(self):
        outputs = []
        for request_id, req in list(self.running.items()):
            req["made"] += 1
            token = 10 * self.weights + req["made"]
            if req["prompt"][0] in self.stops and req["made"] == 3:
                token = STOP
            done = token == STOP or req["made"] == req["params"].max_tokens
            lp = -(self.weights + 1) / 10
            completion = SimpleNamespace(
                token_ids=[token],
                logprobs=[{token: SimpleNamespace(logprob=lp)}],
                finish_reason=("stop" if token == STOP else "length") if done else None,
            )
            outputs.append(
                SimpleNamespace(request_id=request_id, outputs=[completion], finished=done)
            )
            if done:
                del self.running[request_id]
        return outputs


class _Boundary:
    """The engine lock as a generation sees it: a swap waits before the k-th step; lending
    runs it (the stand-in's weights and the engine's version become 1, or -1 if it fails)."""

    def __init__(self, engine, core, k, fail=False):
        self.engine, self.core, self.k, self.fail = engine, core, k, fail
        self.checks = 0

    @property
    def swap_waiting(self):
        self.checks += 1
        return self.checks == self.k

    def lend_if_asked(self):
        self.core.log.append(("swap",))
        self.core.weights = 1
        self.engine.weight_version = -1 if self.fail else 1
        return True


def _engine(core) -> VllmEngine:
    engine = object.__new__(VllmEngine)  # VllmEngine without vllm
    engine.llm = SimpleNamespace(llm_engine=core)
    engine.weight_version, engine.asleep, engine.eos_ids = 0, set(), (STOP,)
    engine._vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    engine._delta_output = DELTA
    return engine


def test_a_swap_aborts_then_continues_each_response_from_its_tokens_so_far():
    core = _StandInEngineCore(stops={7})
    engine = _engine(core)
    prompts = Ragged.from_lists([[1, 2, 3], [7, 8]])
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=4)
    # Steps 1-3 under weights 0; prompt [7, 8]'s samples stop at their 3rd token.
    result = engine.generate(prompts, params, at_token_boundary=_Boundary(engine, core, k=4))

    assert result.responses.tolist() == [
        [1, 2, 3, 11, 12, 13],  # 3 tokens of weights 0, then 3 of weights 1 (a new request)
        [1, 2, 3, 11, 12, 13],
        [1, 2, STOP],
        [1, 2, STOP],
    ]
    assert result.token_versions is not None and result.weight_version == 1
    assert result.token_versions.tolist() == [[0, 0, 0, 1, 1, 1]] * 2 + [[0, 0, 0]] * 2
    old, new = -0.1, -0.2
    want = [[old] * 3 + [new] * 3] * 2 + [[old] * 3] * 2
    assert result.logprobs.values.tolist() == pytest.approx(sum(want, []))
    assert result.finish_reasons == ["length", "length", "stop", "stop"]

    kinds = [entry[0] for entry in core.log]
    assert kinds == ["add"] * 4 + ["abort", "swap", "add", "add"]  # aborted before the swap
    first = {entry[1]: entry for entry in core.log[:4]}
    aborted = core.log[4][1]
    assert aborted == sorted(r for r in first if first[r][2] == [1, 2, 3])
    for (_, request_id, prompt, max_tokens, seed), old_id in zip(
        core.log[6:], aborted, strict=True
    ):
        assert prompt == [1, 2, 3, 1, 2, 3] and max_tokens == 3  # prompt + tokens so far
        assert request_id != old_id and seed != first[old_id][4]  # a part of its own


def test_without_a_swap_the_samples_are_seeded_as_the_plain_path_seeds_prompts():
    core = _StandInEngineCore()
    engine = _engine(core)
    params = SamplingParams(max_tokens=2, n=1, seed=9)
    boundary = _Boundary(engine, core, k=0)  # never
    result = engine.generate(Ragged.from_lists([[1], [2]]), params, at_token_boundary=boundary)
    assert result.token_versions is None and result.weight_version == 0
    seeds = [entry[4] for entry in core.log if entry[0] == "add"]
    assert seeds == [k["seed"] for k in mapping.per_prompt_kwargs(params, 2)]


def test_a_swap_that_failed_half_way_stops_the_generation_and_its_requests():
    core = _StandInEngineCore()
    engine = _engine(core)
    boundary = _Boundary(engine, core, k=2, fail=True)
    with pytest.raises(WeightsMixedError, match="mix of two versions"):
        engine.generate(
            Ragged.from_lists([[1, 2]]), SamplingParams(max_tokens=5), at_token_boundary=boundary
        )
    assert not core.running


def test_continuation_keywords():
    kwargs = {"max_tokens": 10, "seed": 5, "n": 1}
    assert mapping.continuation_kwargs(kwargs, 0, 0) == kwargs
    later = mapping.continuation_kwargs(kwargs, 4, 1)
    assert later["max_tokens"] == 6 and later["seed"] not in (5, 6)
    assert "seed" not in mapping.continuation_kwargs({"max_tokens": 3}, 1, 2)
    samples = mapping.per_sample_kwargs(SamplingParams(n=3, seed=1, max_tokens=4), 2)
    assert len(samples) == 6 and all(k["n"] == 1 for k in samples)
    assert len({k["seed"] for k in samples}) == 6
