"""The native engine on a GPU: the same answers as on CPU (skipped without CUDA)."""

import pytest
import torch

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1], [1, 5, 6], [1, 4, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=10, max_tokens=12, n=3, seed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def gpu(model_dir):
    return NativeEngine(model_dir, device="cuda")


def test_greedy_on_gpu_equals_cpu_and_each_prompt_alone(gpu, model_dir):
    on_gpu = gpu.generate(Ragged.from_lists(PROMPTS), GREEDY)
    on_cpu = NativeEngine(model_dir).generate(Ragged.from_lists(PROMPTS), GREEDY)
    assert on_gpu.responses.tolist() == on_cpu.responses.tolist()
    torch.testing.assert_close(on_gpu.logprobs.values, on_cpu.logprobs.values, atol=1e-4, rtol=0)
    for i, prompt in enumerate(PROMPTS):
        alone = gpu.generate(Ragged.from_lists([prompt]), GREEDY)
        assert alone.responses.row(0).tolist() == on_gpu.responses.row(i).tolist()


def test_seeded_sampling_repeats_and_matches_compute_logprobs(gpu):
    prompts = Ragged.from_lists(PROMPTS)
    first = gpu.generate(prompts, SAMPLED)
    again = gpu.generate(prompts, SAMPLED)
    assert first.responses.tolist() == again.responses.tolist()
    repeated = prompts.select([i for i in range(len(PROMPTS)) for _ in range(SAMPLED.n)])
    scores = gpu.score(repeated, first.responses, SAMPLED.temperature, with_entropy=True)
    torch.testing.assert_close(scores.logprobs.values, first.logprobs.values, atol=1e-5, rtol=0)
    assert scores.entropy.values.shape == first.logprobs.values.shape


def test_bfloat16_on_gpu_and_weights_from_cpu_tensors(gpu, model_dir):
    engine = NativeEngine(model_dir, device="cuda", dtype="bfloat16")
    out = engine.generate(Ragged.from_lists(PROMPTS), SAMPLED)
    repeated = Ragged.from_lists([p for p in PROMPTS for _ in range(SAMPLED.n)])
    scored = engine.compute_logprobs(repeated, out.responses, SAMPLED.temperature)
    torch.testing.assert_close(scored.values, out.logprobs.values, atol=0.1, rtol=0)
    source = NativeEngine(model_dir).runner.model
    engine.load_weights((n, p.detach()) for n, p in source.named_parameters())
    weight = engine.runner.model.get_input_embeddings().weight
    assert weight.device.type == "cuda" and weight.dtype == torch.bfloat16
