"""The engine-against-``generate`` benchmark's helpers on the CPU with a tiny model: pairs
timed in turn with their ratios, and ``generate`` under another attention implementation
for one call only; the engines side by side (fast or native, meshrl's vLLM, bare vLLM) in
their CPU dry run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rollout.engine import hf_speed, pair_ratios, side_by_side
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.rollout.fast.engine import FastEngine

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return FastEngine(str(make_tiny_qwen2_dir(tmp_path_factory.mktemp("tiny"))), max_num_seqs=4)


def test_pair_ratios_are_each_pairs_own():
    result = pair_ratios([{"engine": 100.0, "eager": 10.0}, {"engine": 90.0, "eager": 12.0}])
    assert [p["ratio"] for p in result["pairs"]] == [10.0, 7.5]
    assert result["min_ratio"] == 7.5 and result["max_ratio"] == 10.0
    assert result["median_ratio"] == 8.75


def test_side_by_side_times_the_engine_and_generate_in_turn(engine):
    result = side_by_side(engine, batch=4, pairs=2, prompt_len=8, new=8)
    assert len(result["pairs"]) == 2
    for pair in result["pairs"]:
        assert pair["engine"] > 0 and pair["eager"] > 0
        assert pair["ratio"] == pytest.approx(pair["engine"] / pair["eager"])
        assert pair["engine_first_call_s"] > 0 and pair["eager_first_call_s"] > 0
    assert result["min_ratio"] <= result["median_ratio"] <= result["max_ratio"]


def test_generate_with_eager_attention_puts_the_loaded_one_back(engine):
    model = engine.runner.model
    loaded = model.config._attn_implementation
    result = hf_speed(model, batch=2, prompt_len=8, new=8, static=False, attention="eager")
    assert result["attn_implementation"] == "eager"
    assert 0 < result["new_tokens"] <= 2 * 8
    assert model.config._attn_implementation == loaded != "eager"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_engines_side_by_side_dry_run_on_the_cpu_with_bare_vllm(tmp_path):
    """``engines_side_by_side.py``'s CPU dry run: the native engine, meshrl's vLLM engine and
    bare ``vllm.LLM.generate`` in one call, each timed with and without log-probs and seeds;
    bare vLLM's raw record names its version, its ``LLM`` arguments and every sampling
    setting, which are those meshrl's engine sends."""
    from benchmarks.rollout.engines_side_by_side import BareVllm
    from services.rollout.types import SamplingParams
    from services.rollout.vllm.mapping import per_prompt_kwargs

    cmd = [
        sys.executable, "-m", "benchmarks.rollout.engines_side_by_side",
        "--engines", "native,vllm,vllm_bare", "--shapes", "tiny", "--device", "cpu",
        "--batches", "2", "--runs", "1", "--prompt-len", "8", "--new-tokens", "4",
        "--check-shape", "none", "--samplings", "seeded_logprobs,plain",
        "--workdir", str(tmp_path / "models"), "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "rollout_engines_side_by_side.json").read_text())
    engines = report["shapes"]["tiny"]
    for name in ("native", "vllm", "vllm_bare"):
        assert "error" not in engines[name], engines[name]
        for kind in ("speed", "speed_plain"):
            assert engines[name][kind]["2"]["median_tok_s"] > 0
    bare = engines["vllm_bare"]
    assert bare["vllm_version"] == engines["vllm"]["vllm_version"]
    assert bare["llm_kwargs"]["logprobs_mode"] == "processed_logprobs"
    assert bare["llm_kwargs"]["skip_tokenizer_init"] and bare["llm_kwargs"]["enforce_eager"]
    seeded = bare["speed"]["2"]["sampling_params"]["first_prompt"]
    plain = bare["speed_plain"]["2"]["sampling_params"]["first_prompt"]
    # what meshrl's engine sends for the same request (the model has no EOS)
    ours = per_prompt_kwargs(SamplingParams(temperature=1.0, max_tokens=4, seed=1), 2)
    assert seeded == ours[0] and seeded["logprobs"] == 0
    plain_ours = per_prompt_kwargs(SamplingParams(max_tokens=4, logprobs=False), 2)
    assert plain == plain_ours[0] and plain["logprobs"] is None and "seed" not in plain
    assert BareVllm.sampling_kwargs(None, 2, 4, 1, True) == ours  # type: ignore[arg-type]
    assert "vllm_bare (plain)" in done.stdout  # the table's row
