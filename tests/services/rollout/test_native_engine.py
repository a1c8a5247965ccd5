"""The native engine in-process, on a tiny random Llama (hidden 64, 2 layers, 22 tokens)."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from meshrl.ragged import Ragged
from meshrl.testing.char_tokenizer import save_char_tokenizer
from meshrl.testing.tiny_model import make_tiny_model_dir, tiny_llama_config
from services.rollout.engine import MemoryReleasedError, RolloutEngine
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

# Prompts of different lengths (1, 3, 7, 12 tokens), so batches need real left padding.
PROMPTS = [[1], [1, 5, 6], [1, 4, 5, 6, 7, 8, 9], [1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def engine(model_dir):
    return NativeEngine(model_dir)


def _greedy_alone(engine, prompt, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return engine.generate(Ragged.from_lists([prompt]), params)


def test_native_engine_implements_the_interface(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.vocab_size == 22 and engine.num_parameters > 0 and engine.weight_version == 0


def test_batched_greedy_equals_each_prompt_alone(engine):
    batched = engine.generate(Ragged.from_lists(PROMPTS), GREEDY)
    assert len(batched.responses) == len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        alone = _greedy_alone(engine, prompt)
        assert batched.responses.row(i).tolist() == alone.responses.row(0).tolist()
        torch.testing.assert_close(
            batched.logprobs.row(i), alone.logprobs.row(0), atol=1e-5, rtol=0
        )


def test_result_layout_and_dtypes(engine):
    out = engine.generate(Ragged.from_lists(PROMPTS), GREEDY)
    assert out.responses.values.dtype == torch.int64
    assert out.logprobs.values.dtype == torch.float32
    assert torch.equal(out.logprobs.offsets, out.responses.offsets)
    assert len(out.finish_reasons) == len(PROMPTS)
    assert out.weight_version == engine.weight_version
    assert bool((out.logprobs.values <= 0).all())


def test_same_seed_same_tokens_other_seed_other_tokens(engine):
    prompts = Ragged.from_lists(PROMPTS)
    params = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=7)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=8))
    assert a.responses.tolist() == b.responses.tolist()
    assert torch.equal(a.logprobs.values, b.logprobs.values)
    assert a.responses.tolist() != c.responses.tolist()


def test_n_samples_are_grouped_by_prompt(model_dir):
    # max_num_seqs=4 with n=3: chunks of 4 sequences cut through the groups of a prompt.
    small = NativeEngine(model_dir, max_num_seqs=4)
    out = small.generate(
        Ragged.from_lists(PROMPTS[:3]), SamplingParams(temperature=0, max_tokens=6, n=3)
    )
    assert len(out.responses) == 9
    for i, prompt in enumerate(PROMPTS[:3]):
        alone = _greedy_alone(small, prompt, max_tokens=6).responses.row(0).tolist()
        for j in range(3):
            assert out.responses.row(i * 3 + j).tolist() == alone, (i, j)


def test_sampled_n_samples_differ_within_a_group(engine):
    out = engine.generate(
        Ragged.from_lists([[1, 4]]), SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=0)
    )
    assert len({tuple(r) for r in out.responses.tolist()}) > 1


def test_max_tokens_ends_with_length(engine):
    out = engine.generate(
        Ragged.from_lists(PROMPTS), SamplingParams(temperature=0, max_tokens=5, stop_token_ids=())
    )
    for i in range(len(PROMPTS)):
        if out.finish_reasons[i] == "length":
            assert len(out.responses.row(i)) == 5
        else:  # the random model happened to sample EOS
            assert int(out.responses.row(i)[-1]) in engine.eos_token_ids


def test_stop_token_is_included_and_finishes_with_stop(engine):
    free = _greedy_alone(engine, PROMPTS[2]).responses.row(0).tolist()
    stop = free[3]
    cut = free.index(stop) + 1  # the first time the greedy path produces it
    out = engine.generate(
        Ragged.from_lists([PROMPTS[2], PROMPTS[0]]),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,)),
    )
    assert out.responses.row(0).tolist() == free[:cut]
    assert out.finish_reasons[0] == "stop"
    assert len(out.logprobs.row(0)) == cut
    # The other row goes on alone after row 0 stopped (the batch is compacted under it).
    other = out.responses.row(1).tolist()
    alone = _greedy_alone(engine, PROMPTS[0]).responses.row(0).tolist()
    if stop in alone:
        assert other == alone[: alone.index(stop) + 1]
    else:
        assert other == alone and out.finish_reasons[1] == "length"


def test_eos_from_generation_config_stops(tmp_path, engine):
    free = _greedy_alone(engine, PROMPTS[1]).responses.row(0).tolist()
    eos = free[2]
    path = make_tiny_model_dir(tmp_path / "eos")  # same seed: same weights as `engine`
    config_file = path / "generation_config.json"
    gen_config = json.loads(config_file.read_text())
    gen_config["eos_token_id"] = [2, eos]
    config_file.write_text(json.dumps(gen_config))
    eos_engine = NativeEngine(str(path))
    assert set(eos_engine.eos_token_ids) == {2, eos}
    out = eos_engine.generate(Ragged.from_lists([PROMPTS[1]]), GREEDY)
    assert out.responses.row(0).tolist() == free[: free.index(eos) + 1]
    assert out.finish_reasons == ["stop"]


def test_top_k_1_equals_greedy(engine):
    prompts = Ragged.from_lists(PROMPTS)
    greedy = engine.generate(prompts, GREEDY)
    top1 = engine.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, seed=3))
    assert top1.responses.tolist() == greedy.responses.tolist()
    # Both report log-probs at temperature 1.
    torch.testing.assert_close(top1.logprobs.values, greedy.logprobs.values, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=8, max_tokens=10, n=2, seed=1),
        SamplingParams(temperature=1.3, max_tokens=10, n=3, seed=2),
    ],
)
def test_generate_logprobs_equal_compute_logprobs(engine, params):
    prompts = Ragged.from_lists(PROMPTS)
    out = engine.generate(prompts, params)
    repeated = prompts.select([i for i in range(len(PROMPTS)) for _ in range(params.n)])
    scored = engine.compute_logprobs(repeated, out.responses, params.logprob_temperature)
    assert torch.equal(scored.offsets, out.responses.offsets)
    torch.testing.assert_close(scored.values, out.logprobs.values, atol=1e-5, rtol=0)


def test_compute_logprobs_matches_a_plain_forward(engine):
    prompt, response = [1, 4, 5], [6, 7, 8, 2]
    scores = engine.score(
        Ragged.from_lists([prompt, [1]]), Ragged.from_lists([response, []]), 0.5, with_entropy=True
    )
    assert scores.logprobs.lengths.tolist() == [4, 0]
    ids = torch.tensor([prompt + response])
    logits = engine.runner.model(input_ids=ids).logits[0, 2:-1].float() / 0.5  # predict 6, 7, 8, 2
    logp = logits.log_softmax(-1)
    expected = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    torch.testing.assert_close(scores.logprobs.values, expected, atol=1e-5, rtol=0)
    entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(scores.entropy.values, entropy, atol=1e-5, rtol=0)


def test_empty_batch_gives_empty_result(engine):
    empty = Ragged(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    out = engine.generate(empty, SamplingParams(max_tokens=4, n=2))
    assert len(out.responses) == 0 and out.finish_reasons == []
    assert len(engine.compute_logprobs(empty, empty, 1.0)) == 0


def test_bad_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\] holds token id 22"):
        engine.generate(Ragged.from_lists([[1, 2], [1, 22]]), GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds token id -1"):
        engine.generate(Ragged.from_lists([[-1]]), GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate(Ragged.from_lists([[1], []]), GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        engine.compute_logprobs(Ragged.from_lists([[1], [1]]), Ragged.from_lists([[4]]), 1.0)


def test_prompt_over_the_model_length_is_refused_naming_it(model_dir):
    # Without a limit the engine ran the model on positions past max_model_len without a word.
    short = NativeEngine(model_dir, max_model_len=20)
    prompts = Ragged.from_lists([[1, 4], [1] * 15])
    with pytest.raises(
        ValueError, match=r"prompts\[1\] has 15 tokens.*max_tokens 6.*max_model_len 20"
    ):
        short.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert len(short.generate(prompts, SamplingParams(temperature=0, max_tokens=5)).responses) == 2


def test_model_length_defaults_to_the_models_positions(engine):
    assert engine.max_model_len == 256  # tiny_llama_config's max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate(Ragged.from_lists([[1] * 250]), SamplingParams(max_tokens=7))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "sampling.n"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"temperature": -1.0}, "sampling.temperature"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_released_memory_refuses_generation_until_resumed(engine):
    engine.release_memory()
    try:
        with pytest.raises(MemoryReleasedError):
            engine.generate(Ragged.from_lists([[1]]), GREEDY)
    finally:
        engine.resume_memory()
    assert len(engine.generate(Ragged.from_lists([[1]]), GREEDY).responses) == 1


def test_load_weights_changes_outputs_to_the_new_models(tmp_path, model_dir):
    target = NativeEngine(model_dir)
    other_dir = str(make_tiny_model_dir(tmp_path / "other", seed=1))
    other = NativeEngine(other_dir)
    prompts = Ragged.from_lists(PROMPTS)
    before = target.generate(prompts, GREEDY)
    expected = other.generate(prompts, GREEDY)
    assert before.responses.tolist() != expected.responses.tolist()
    target.load_weights((n, p.detach().clone()) for n, p in other.runner.model.named_parameters())
    after = target.generate(prompts, GREEDY)
    assert after.responses.tolist() == expected.responses.tolist()
    torch.testing.assert_close(after.logprobs.values, expected.logprobs.values, atol=1e-6, rtol=0)


def test_load_weights_casts_to_the_engine_dtype(model_dir):
    engine = NativeEngine(model_dir, dtype="bfloat16")
    weight = torch.ones(22, 64, dtype=torch.float32)
    engine.load_weights([("model.embed_tokens.weight", weight)])
    loaded = engine.runner.model.get_input_embeddings().weight
    assert loaded.dtype == torch.bfloat16 and bool((loaded == 1).all())


def test_load_weights_rejects_unknown_names_and_shapes(model_dir):
    engine = NativeEngine(model_dir)
    with pytest.raises(ValueError, match="no parameter named 'model.nope.weight'"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_load_weights_with_tied_lm_head(tmp_path):
    path = tmp_path / "tied"
    path.mkdir()
    tok = save_char_tokenizer(path)
    config = tiny_llama_config(len(tok), hidden=32, intermediate=64)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    engine = NativeEngine(str(path))
    model = engine.runner.model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    # A sender that skips the tied lm_head ...
    engine.load_weights([("model.embed_tokens.weight", torch.full((22, 32), 0.5))])
    assert bool((model.lm_head.weight == 0.5).all())
    # ... or sends it under its own name: both land in the one shared tensor.
    engine.load_weights([("lm_head.weight", torch.full((22, 32), 0.25))])
    assert bool((model.get_input_embeddings().weight == 0.25).all())


def test_bfloat16_engine_generates_close_to_its_full_forward(model_dir):
    engine = NativeEngine(model_dir, dtype="bfloat16")
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    out = engine.generate(Ragged.from_lists(PROMPTS), params)
    scored = engine.compute_logprobs(Ragged.from_lists(PROMPTS), out.responses, 1.0)
    assert scored.values.dtype == torch.float32
    # bf16 activations: cached decode and a full forward round differently.
    torch.testing.assert_close(scored.values, out.logprobs.values, atol=0.1, rtol=0)
