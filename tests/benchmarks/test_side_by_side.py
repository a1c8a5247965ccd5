"""The engine-against-``generate`` benchmark's helpers on the CPU with a tiny model: pairs
timed in turn with their ratios, and ``generate`` under another attention implementation
for one call only."""

import pytest

from benchmarks.rollout.engine import hf_speed, pair_ratios, side_by_side
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.rollout.fast.engine import FastEngine

pytestmark = pytest.mark.timeout(180)


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
