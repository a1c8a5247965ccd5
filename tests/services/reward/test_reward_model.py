"""Reward model: a tiny Llama classification model built from a config (no downloads)."""

import json

import pytest
import torch
from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

from meshrl.config.schema import RewardConfig, RewardModelConfig
from meshrl.testing.char_tokenizer import save_char_tokenizer
from meshrl.testing.tiny_model import tiny_llama_config
from services.reward.reward_model import RewardModel, prompt_messages
from services.reward.scoring import RewardScorer
from services.reward.types import ScoreItem

pytestmark = pytest.mark.timeout(120)


def make_rm(path, cls):
    tok = save_char_tokenizer(path)
    config = tiny_llama_config(len(tok), hidden=32, layers=2, heads=2, intermediate=64)
    config.num_labels = 1
    torch.manual_seed(0)
    model = cls(config)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def seq_rm(tmp_path_factory):
    return make_rm(tmp_path_factory.mktemp("seq_rm"), LlamaForSequenceClassification)


@pytest.fixture(scope="module")
def tok_rm(tmp_path_factory):
    return make_rm(tmp_path_factory.mktemp("tok_rm"), LlamaForTokenClassification)


PROMPTS = ["Q: 1+2=", "Q: 12+30=", json.dumps([{"role": "user", "content": "Q: 7*6="}]), "Q: 9-9="]
RESPONSES = ["3", "42 # 42", "42", "0000000000"]


def unpadded(rm: RewardModel, prompt: str, response: str, per_token: bool) -> float:
    """The score of one pair on its own: no padding, default positions."""
    ids = rm.tokenizer(rm.render(prompt, response), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ids[-rm.max_length :]])
    with torch.no_grad():
        logits = rm.model(input_ids=ids).logits
    return float(logits[0, -1, 0] if per_token else logits[0, 0])


@pytest.mark.parametrize(("fixture", "per_token"), [("seq_rm", False), ("tok_rm", True)])
def test_batched_scores_equal_one_by_one(request, fixture, per_token):
    rm = RewardModel(str(request.getfixturevalue(fixture)), micro_batch_size=3, device="cpu")
    assert rm.per_token is per_token
    got = rm.score(PROMPTS, RESPONSES)
    want = [unpadded(rm, p, r, per_token) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(got)) == len(got)  # the pairs really differ


def test_truncation_keeps_the_end(seq_rm):
    rm = RewardModel(str(seq_rm), max_length=6, device="cpu")
    long_prompt = "Q: " + "1+" * 20 + "1="
    got = rm.score([long_prompt, "Q: 1="], ["21", "1"])
    assert got == pytest.approx(
        [unpadded(rm, long_prompt, "21", False), unpadded(rm, "Q: 1=", "1", False)], abs=1e-5
    )


def test_render_uses_the_rm_chat_template(seq_rm):
    rm = RewardModel(str(seq_rm), device="cpu")
    # the char tokenizer's template: BOS, then the contents
    assert rm.render(PROMPTS[2], "42") == "<s>Q: 7*6=42"
    assert prompt_messages("plain text") == [{"role": "user", "content": "plain text"}]
    assert prompt_messages("[not json") == [{"role": "user", "content": "[not json"}]


def test_rule_and_model_scores_combine(seq_rm):
    cfg = RewardConfig(
        num_workers=1,
        reward_model=RewardModelConfig(enable=True, path=str(seq_rm), weight=0.5),
    )
    items = [
        ScoreItem("openai/gsm8k", "#### 3", "3", prompt="Q: 1+2="),
        ScoreItem("Dahoas/full-hh-rlhf", "hi", "", prompt="Q: hello"),  # no rule scorer: RM only
    ]
    with RewardScorer(cfg) as s:
        out = s.score(items)
        rm = s.reward_model.score([it.prompt for it in items], [it.response for it in items])
    assert out[0].score == pytest.approx(1.0 + 0.5 * rm[0])
    assert out[0].extra["rule_score"] == 1.0 and out[0].extra["rm_score"] == pytest.approx(rm[0])
    assert out[1].score == pytest.approx(0.5 * rm[1])
    assert "rule_score" not in out[1].extra and out[1].ok


def test_rm_enabled_without_path():
    cfg = RewardConfig(num_workers=1, reward_model=RewardModelConfig(enable=True))
    with pytest.raises(ValueError, match="reward.reward_model.path is empty"):
        RewardScorer(cfg)
