"""Partial rollouts inside the engines: a weight swap lands at a token boundary of a running
generation, and every token carries the version and the log-prob of the weights that
sampled it (``partial_rollout_checks.py`` says exactly what is equal to what).

The swap here is done by the boundary callback itself, in process, at a chosen boundary;
``test_partial_rollout_server.py`` does it with a real sync into a server process.
"""

from __future__ import annotations

import pytest
import torch
from partial_rollout_checks import (
    full_forward_logprobs,
    keep_logprobs,
    response_rows,
    split_point,
)

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.rollout.engine import WeightsMixedError
from services.rollout.fast.engine import FastEngine
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9, 10, 11]]
T = 0.9


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(make_tiny_model_dir(root / "a", seed=0)), str(
        make_tiny_model_dir(root / "b", seed=1)
    )


@pytest.fixture(scope="module")
def references(model_dirs):
    """Plain engines on the old (version 0) and the new (version 1) weights."""
    return NativeEngine(model_dirs[0]), NativeEngine(model_dirs[1])


class SwapAt:
    """A token boundary (what the engine lock shows a generation) that swaps in ``new``'s
    weights as version 1 when the generation lends the engine for the k-th time."""

    def __init__(self, engine, new: NativeEngine, k: int, fail: bool = False):
        self.engine, self.new, self.k, self.fail = engine, new, k, fail
        self.calls = 0

    @property
    def swap_waiting(self) -> bool:
        return self.calls + 1 == self.k

    def lend_if_asked(self) -> bool:
        self.calls += 1
        if self.calls != self.k:
            return False
        self.engine.load_weights(self.new.runner.model.named_parameters())
        self.engine.weight_version = -1 if self.fail else 1
        return True


def _engine(kind: str, model_dir: str, kv: str, max_num_seqs: int):
    if kind == "native":
        return NativeEngine(model_dir, partial_rollout_kv=kv, max_num_seqs=max_num_seqs)
    return FastEngine(model_dir, partial_rollout_kv=kv, max_num_seqs=max_num_seqs, check_every=2)


def check_spanning_responses(result, references, kv: str, params: SamplingParams) -> list[int]:
    """Checks each response's versions and log-probs; returns its count of old tokens."""
    old, new = references
    assert result.weight_version == 1 and result.token_versions is not None
    splits = []
    for i, (response, versions, lps) in enumerate(response_rows(result)):
        prompt = PROMPTS[i // params.n]
        k = split_point(versions, 0, 1)
        splits.append(k)
        lps = torch.tensor(lps)
        if k:
            want_old = full_forward_logprobs(old, prompt, response, T)[:k]
            torch.testing.assert_close(lps[:k], want_old, atol=1e-5, rtol=0)
        if k == len(response):
            continue
        if kv == "recompute" or k == 0:  # k == 0: the whole response under the new weights
            want_new = full_forward_logprobs(new, prompt, response, T)[k:]
        else:
            want_new = keep_logprobs(old, new, prompt, response, k, T)
            # ... which is not what a forward under the new weights alone gives
            alone = full_forward_logprobs(new, prompt, response, T)[k:]
            assert not torch.allclose(lps[k:], alone, atol=1e-3)
        torch.testing.assert_close(lps[k:], want_new, atol=1e-5, rtol=0)
    return splits


@pytest.mark.parametrize("kv", ["keep", "recompute"])
@pytest.mark.parametrize("kind", ["native", "fast"])
def test_a_response_spanning_a_swap_has_each_tokens_version_and_logprob(
    model_dirs, references, kind, kv
):
    engine = _engine(kind, model_dirs[0], kv, max_num_seqs=8)
    params = SamplingParams(temperature=T, max_tokens=16, n=2, seed=3)
    swap = SwapAt(engine, references[1], k=4)
    result = engine.generate(Ragged.from_lists(PROMPTS), params, at_token_boundary=swap)
    splits = check_spanning_responses(result, references, kv, params)
    # Every sequence had started (one chunk) and some ran on past the swap.
    assert all(k > 0 for k in splits) and any(
        k < n for k, n in zip(splits, result.responses.lengths.tolist(), strict=True)
    )


@pytest.mark.parametrize("kind", ["native", "fast"])
def test_sequences_started_after_the_swap_are_all_new(model_dirs, references, kind):
    # 2 rows/slots for 6 sequences: the swap lands while the first ones decode; the others
    # start under the new weights.
    engine = _engine(kind, model_dirs[0], "keep", max_num_seqs=2)
    params = SamplingParams(temperature=T, max_tokens=10, n=2, seed=5)
    swap = SwapAt(engine, references[1], k=3)
    result = engine.generate(Ragged.from_lists(PROMPTS), params, at_token_boundary=swap)
    splits = check_spanning_responses(result, references, "keep", params)
    assert splits[-1] == 0 and splits[0] > 0


def test_without_a_swap_nothing_changes(model_dirs):
    engine = NativeEngine(model_dirs[0])
    params = SamplingParams(temperature=T, max_tokens=8, n=2, seed=1)
    prompts = Ragged.from_lists(PROMPTS)
    plain = engine.generate(prompts, params)
    lent = engine.generate(prompts, params, at_token_boundary=SwapAt(engine, engine, k=0))
    assert plain.token_versions is None and lent.token_versions is None
    assert plain.responses.tolist() == lent.responses.tolist() and lent.weight_version == 0


@pytest.mark.parametrize("kind", ["native", "fast"])
def test_a_swap_that_failed_half_way_stops_the_generation(model_dirs, references, kind):
    engine = _engine(kind, model_dirs[0], "keep", max_num_seqs=8)
    swap = SwapAt(engine, references[1], k=3, fail=True)
    with pytest.raises(WeightsMixedError, match="mix of two versions"):
        engine.generate(
            Ragged.from_lists(PROMPTS),
            SamplingParams(temperature=T, max_tokens=16, seed=2),
            at_token_boundary=swap,
        )
