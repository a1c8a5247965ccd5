"""The fast path on a GPU: CUDA-graph decode equals the eager decode and the plain engine
(float32, tiny model), and the KV cache really leaves the GPU on release (skipped without CUDA)."""

import pytest
import torch

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.rollout.fast.engine import FastEngine
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    return FastEngine(path, device="cuda", max_num_seqs=6, gpu_memory_utilization=0.05)


def _prompts(seed: int) -> Ragged:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 40, (11,), generator=g).tolist()
    return Ragged.from_lists(
        [[1] + torch.randint(4, 22, (n,), generator=g).tolist() for n in lengths]
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_graphs_equal_eager_and_plain_engine(engine, seed):
    prompts = _prompts(seed)
    params = SamplingParams(temperature=0, max_tokens=40, n=2, stop_token_ids=(9,))
    graphs = engine.generate(prompts, params)
    engine.graphs.enabled = False
    eager = engine.generate(prompts, params)
    engine.graphs.enabled = True
    plain = NativeEngine.generate(engine, prompts, params)
    assert graphs.responses.tolist() == eager.responses.tolist() == plain.responses.tolist()
    assert graphs.finish_reasons == plain.finish_reasons
    torch.testing.assert_close(graphs.logprobs.values, plain.logprobs.values, atol=1e-4, rtol=0)
    assert engine.graphs.num_graphs > 0


def test_release_returns_the_cache_to_the_gpu(engine):
    params = SamplingParams(temperature=0, max_tokens=8)
    before = engine.generate(_prompts(5), params)
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    assert torch.cuda.memory_allocated() <= held - engine.cache.capacity_tokens  # really freed
    assert engine.kv_cache_bytes == 0
    engine.resume_memory()
    assert engine.generate(_prompts(5), params).responses.tolist() == before.responses.tolist()
