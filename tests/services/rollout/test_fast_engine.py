"""The fast path (static KV cache, slots, own decoder forward) against the plain engine.

On CPU the fast path runs eagerly (no CUDA graphs), which checks everything but the
capture: greedy tokens must equal the plain engine's on fresh random prompts, including
refilled slots, stop tokens and n samples per prompt.
"""

import threading

import pytest
import torch

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir, make_tiny_qwen2_dir
from services.rollout.engine import GenerationCancelled, MemoryReleasedError
from services.rollout.fast.engine import FastEngine
from services.rollout.fast.scheduler import Scheduler
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return str(make_tiny_model_dir(path))
    return str(make_tiny_qwen2_dir(path))


def _random_prompts(seed: int, count: int, longest: int = 20) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, longest, (count,), generator=g).tolist()
    return Ragged.from_lists(
        [[1] + torch.randint(4, 22, (n,), generator=g).tolist() for n in lengths]
    )


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_greedy_equals_plain_engine_with_refills_and_stops(model_dir, seed):
    plain = NativeEngine(model_dir)
    # 5 slots for 9 prompts x 2 samples: slots are refilled several times.
    fast = FastEngine(model_dir, max_num_seqs=5, check_every=3)
    prompts = _random_prompts(seed, 9)
    for stop in [(), (7, 8, 9)]:
        params = SamplingParams(temperature=0, max_tokens=25, n=2, stop_token_ids=stop)
        want = plain.generate(prompts, params)
        got = fast.generate(prompts, params)
        assert got.responses.tolist() == want.responses.tolist()
        assert got.finish_reasons == want.finish_reasons
        torch.testing.assert_close(got.logprobs.values, want.logprobs.values, atol=1e-5, rtol=0)
    assert "stop" in got.finish_reasons  # the stop tokens were hit at least once


@pytest.mark.parametrize("read_late", [True, False])
def test_checks_read_a_round_late_lose_nothing(model_dir, read_late):
    # All 7 sequences fit the 8 slots: nothing waits, so with read_late each check is read
    # after the next round is queued; stop tokens end some early (their slots step on,
    # unseen, for a round) and the rest run to max_tokens; compaction moves the survivors.
    plain = NativeEngine(model_dir)
    fast = FastEngine(model_dir, max_num_seqs=8, check_every=2, read_late=read_late)
    prompts = _random_prompts(5, 7)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=13))
    # Stop tokens that some rows make early (the third tokens of two rows).
    stops = tuple({row[2] for row in free.responses.tolist()[:2]})
    for stop in [(), stops]:
        params = SamplingParams(temperature=0, max_tokens=13, stop_token_ids=stop)
        want = plain.generate(prompts, params)
        got = fast.generate(prompts, params)
        assert got.responses.tolist() == want.responses.tolist()
        assert got.finish_reasons == want.finish_reasons
        torch.testing.assert_close(got.logprobs.values, want.logprobs.values, atol=1e-5, rtol=0)
    assert "stop" in got.finish_reasons and "length" in got.finish_reasons


def test_seeded_sampling_repeats_and_logprobs_match_scoring(model_dir):
    fast = FastEngine(model_dir, max_num_seqs=4)
    prompts = _random_prompts(2, 5)
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, max_tokens=16, n=3, seed=7)
    first, again = fast.generate(prompts, params), fast.generate(prompts, params)
    assert first.responses.tolist() == again.responses.tolist()
    repeated = prompts.select([i for i in range(len(prompts)) for _ in range(3)])
    scores = fast.score(repeated, first.responses, params.temperature, with_entropy=False)
    torch.testing.assert_close(scores.logprobs.values, first.logprobs.values, atol=1e-5, rtol=0)


def test_release_frees_the_cache_and_resume_takes_it_back(model_dir):
    fast = FastEngine(model_dir, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = _random_prompts(3, 3)
    before = fast.generate(prompts, params)
    assert fast.kv_cache_bytes > 0
    fast.release_memory()
    assert fast.kv_cache_bytes == 0
    with pytest.raises(MemoryReleasedError):
        fast.generate(prompts, params)
    fast.resume_memory()
    assert fast.generate(prompts, params).responses.tolist() == before.responses.tolist()


def test_too_long_request_is_refused(model_dir):
    fast = FastEngine(model_dir, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        fast.generate(_random_prompts(0, 2), SamplingParams(max_tokens=31))


def test_scheduler_refills_and_compacts():
    sched = Scheduler([3, 5, 2], n=2, slots=4, max_tokens=4, refill_fraction=0.5)
    assert [seq for seq, _ in sched.admit()] == [0, 1, 2, 3]
    assert sched.width_needed() == 6  # the longest prompt (5) is position 5 next
    assert sched.admit() == []  # no free slot
    sched.advance()
    assert sched.steps_until_check(8) == 2  # 4 tokens: the prefill's + 3 steps
    sched.release(1)
    assert sched.admit() == []  # 1 free slot < refill_at 2 while others run
    sched.release(2)
    assert sched.admit() == [(4, 1), (5, 2)]
    assert sched.release(0, 2, 3) == [0, 5, 3]  # several at once: their sequences
    assert sched.active == [1] and sched.free == [0, 2, 3]
    assert sched.compaction() == ([1], [0]) or sched.compaction() == ([], [])
    sched.move([1], [0])
    assert sched.active == [0] and sched.rows_needed() == 1


def test_loaded_weights_reach_the_fused_projections(model_dir):
    """q/k/v and gate/up run as one GEMM each over a fused buffer that the modules'
    parameters are views of: weights loaded by name must change what decode computes."""
    plain, fast = NativeEngine(model_dir), FastEngine(model_dir, max_num_seqs=4)
    attn = fast.runner.model.model.layers[0].self_attn
    fused = fast.decoder.fused[0]
    assert attn.k_proj.weight.data_ptr() == fused.qkv_weight[fused.q_out :].data_ptr()
    g = torch.Generator().manual_seed(3)
    new = {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for name, p in plain.runner.model.named_parameters()
    }
    plain.load_weights(new.items())
    fast.load_weights(new.items())
    torch.testing.assert_close(
        fused.qkv_weight[: fused.q_out], new["model.layers.0.self_attn.q_proj.weight"]
    )
    prompts = _random_prompts(4, 6)
    params = SamplingParams(temperature=0, max_tokens=12)
    want, got = plain.generate(prompts, params), fast.generate(prompts, params)
    assert got.responses.tolist() == want.responses.tolist()


def test_prefill_plan_puts_each_prompt_in_its_admitted_slots():
    from services.rollout.fast.engine import _prefill_plan

    prompts = Ragged.from_lists([[5, 6], [7], [8, 9, 10]])
    # n = 3 samples a prompt; sequences 3..8 sample prompts 1 and 2, admitted out of order.
    admitted = [(7, 0), (3, 4), (8, 2), (5, 1), (6, 5)]
    plan = _prefill_plan(prompts, [1, 2], admitted, n=3, packed=True)
    assert plan["src"].tolist() == [1, 0, 1, 0, 1]  # the chunk's row of each pair
    assert plan["dest"].tolist() == [0, 4, 2, 1, 5]
    assert plan["ids"].tolist() == [7, 8, 9, 10]
    assert plan["positions"].tolist() == [0, 0, 1, 2]
    assert plan["offsets"].tolist() == [0, 1, 4] and plan["max_len"] == 3
    # A token's row lists its prompt's slots in admission order, -1 where it has fewer.
    assert plan["table"].tolist() == [[4, 1, -1], [0, 2, 5], [0, 2, 5], [0, 2, 5]]
    padded = _prefill_plan(prompts, [1, 2], admitted, n=3, packed=False)
    assert padded["ids"].tolist() == [[7, 0, 0], [8, 9, 10]]
    assert padded["lengths"].tolist() == [1, 3]


class _LeavesAfter(threading.Event):
    """A caller that goes away mid-generation, at the same point every time: set by its
    own `checks`-th read."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks_left = checks

    def is_set(self) -> bool:
        self.checks_left -= 1
        if self.checks_left < 0:
            self.set()
        return super().is_set()


@pytest.mark.parametrize("engine_class", [NativeEngine, FastEngine])
def test_a_cancelled_generation_stops_and_leaves_the_engine_as_it_was(model_dir, engine_class):
    engine = engine_class(model_dir, max_num_seqs=4)
    prompts = _random_prompts(4, 6)  # more sequences than slots: refills are pending too
    params = SamplingParams(temperature=0.9, max_tokens=24, n=2, seed=3)
    with pytest.raises(GenerationCancelled, match="cancelled after [1-9][0-9]* decode steps"):
        engine.generate(prompts, params, _LeavesAfter(checks=3))
    gone = threading.Event()
    gone.set()  # gone before it started (it waited for the engine behind another call)
    with pytest.raises(GenerationCancelled, match="after 0 decode steps"):
        engine.generate(prompts, params, gone)
    # nothing of the abandoned calls is left behind: the same tokens as a fresh engine's
    after = engine.generate(prompts, params, threading.Event())
    fresh = engine_class(model_dir, max_num_seqs=4).generate(prompts, params)
    assert after.responses.tolist() == fresh.responses.tolist()
    torch.testing.assert_close(after.logprobs.values, fresh.logprobs.values, atol=1e-6, rtol=0)
