"""Reward model: a tiny Llama classification model built from a config (no downloads)."""

import json
import logging
import threading
import time
import types

import pytest
import torch
from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

from meshrl.config.sections import RewardConfig, RewardModelConfig
from meshrl.testing.char_tokenizer import build_char_tokenizer, save_char_tokenizer
from meshrl.testing.tiny_model import make_tiny_model_dir, tiny_llama_config
from services.reward import reward_model
from services.reward.reward_model import PAD_WARNING, RewardModel, prompt_messages
from services.reward.scoring import RewardScorer
from services.reward.types import (
    CANCELLED_REASON,
    RewardModelError,
    ScoreItem,
    ScoringCancelled,
)

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


@pytest.fixture(scope="module")
def bert_rm(tmp_path_factory):
    """An encoder reward model: its head reads the first token ([CLS])."""
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("bert_rm")
    tok = save_char_tokenizer(path)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=1, pad_token_id=tok.pad_token_id,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(str(path))
    return path


def test_an_encoder_reward_model_scores_each_pair_as_alone_in_a_batch(bert_rm):
    """Before, it was left-padded as decoders are: its head read a pad, and a pair's score
    changed with the lengths of the pairs beside it (3% on this model, silently)."""
    rm = RewardModel(str(bert_rm), micro_batch_size=4, device="cpu")
    assert rm.encoder and rm.tokenizer.padding_side == "right"
    got = rm.score(PROMPTS, RESPONSES)
    alone = [rm.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert got == pytest.approx(alone, abs=1e-6)
    assert len(set(got)) == len(got)
    # the prompt and the response as a text pair, as encoder reward models are trained
    enc = rm.tokenizer("Q: 1+2=", "3", return_tensors="pt")
    with torch.no_grad():
        want = float(rm.model(**enc).logits[0, 0])
    assert rm.score(["Q: 1+2="], ["3"])[0] == pytest.approx(want, abs=1e-6)


def test_max_length_past_the_models_positions_is_cut_to_them(bert_rm, caplog):
    """Before, a pair longer than BERT's position table failed to index it (default
    max_length 2048 against 256 positions here)."""
    with caplog.at_level("WARNING"):
        rm = RewardModel(str(bert_rm), device="cpu")
    assert rm.max_length == 256
    assert "max_length=2048 exceeds" in caplog.text and "max_position_embeddings=256" in caplog.text
    (score,) = rm.score(["Q: " + "1+" * 200 + "1="], ["401"])
    assert score == score  # a number, not an index error


def test_truncation_keeps_the_end(seq_rm):
    rm = RewardModel(str(seq_rm), max_length=6, device="cpu")
    long_prompt = "Q: " + "1+" * 20 + "1="
    got = rm.score([long_prompt, "Q: 1="], ["21", "1"])
    assert got == pytest.approx(
        [unpadded(rm, long_prompt, "21", False), unpadded(rm, "Q: 1=", "1", False)], abs=1e-5
    )


def test_pairs_cut_to_max_length_are_said_to_be(seq_rm, bert_rm):
    """Before, a pair cut to max_length was scored without a word: a run on long dialogues
    trained on scores of their ends, and nothing showed it."""
    long_prompt = "Q: " + "1+" * 20 + "1="
    decoder = RewardModel(str(seq_rm), max_length=6, device="cpu")
    # "<s>Q:1=1": 6 tokens, at the limit and whole; the long one loses its start
    pairs = decoder.score_pairs([long_prompt, "Q:1="], ["21", "1"])
    assert [pair.cut for pair in pairs] == [True, False]
    assert [pair.score for pair in pairs] == decoder.score([long_prompt, "Q:1="], ["21", "1"])
    encoder = RewardModel(str(bert_rm), max_length=16, device="cpu")
    assert [p.cut for p in encoder.score_pairs([long_prompt, "Q:1="], ["21", "1"])] == [
        True,
        False,
    ]
    # a slow tokenizer keeps no encodings: its rows are counted whole instead, the same way
    texts = [decoder.render(long_prompt, "21"), decoder.render("Q:1=", "1")]
    no_encodings = types.SimpleNamespace(encodings=None)
    assert decoder._cut(no_encodings, texts, add_special_tokens=False) == [True, False]


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


def test_scores_carry_whether_the_pair_was_cut_and_the_first_cut_is_logged(seq_rm, caplog):
    cfg = RewardConfig(
        num_workers=1,
        reward_model=RewardModelConfig(enable=True, path=str(seq_rm), max_length=6),
    )
    items = [
        ScoreItem("Dahoas/full-hh-rlhf", "21", "", prompt="Q: " + "1+" * 20 + "1="),
        ScoreItem("Dahoas/full-hh-rlhf", "1", "", prompt="Q:1="),
    ]
    with RewardScorer(cfg) as s, caplog.at_level("WARNING"):
        whole = s.score(items[1:])
        first, second = s.score(items), s.score(items)
    assert whole[0].extra["rm_cut"] == 0.0
    assert [o.extra["rm_cut"] for o in first] == [o.extra["rm_cut"] for o in second] == [1.0, 0.0]
    [said] = [r.getMessage() for r in caplog.records if "lost their start" in r.getMessage()]
    assert said.startswith("reward model: 1 of 2 (prompt, response) pairs were longer than ")
    assert "reward.reward_model.max_length=6 tokens" in said


def test_the_cut_warning_names_the_models_own_limit_when_max_length_was_capped(bert_rm, caplog):
    """Before, it named reward.reward_model.max_length=256 (the capped value, not the
    configured 2048) and said to raise it, which would change nothing."""
    cfg = RewardConfig(
        num_workers=1, reward_model=RewardModelConfig(enable=True, path=str(bert_rm))
    )
    long_pair = ScoreItem("Dahoas/full-hh-rlhf", "401", "", prompt="Q: " + "1+" * 200 + "1=")
    with RewardScorer(cfg) as s, caplog.at_level("WARNING"):
        (outcome,) = s.score([long_pair])
    assert outcome.extra["rm_cut"] == 1.0
    [said] = [r.getMessage() for r in caplog.records if "lost their start" in r.getMessage()]
    assert "the reward model's max_position_embeddings=256 tokens (which " in said
    assert "reward.reward_model.max_length=2048 was cut to at load)" in said
    assert "raise it" not in said


def test_rm_enabled_without_path():
    cfg = RewardConfig(num_workers=1, reward_model=RewardModelConfig(enable=True))
    with pytest.raises(ValueError, match="reward.reward_model.path is empty"):
        RewardScorer(cfg)


def test_a_set_event_stops_the_reward_model_between_micro_batches(seq_rm):
    rm = RewardModel(str(seq_rm), micro_batch_size=1, device="cpu")
    cancelled = threading.Event()
    forwards = []
    real = rm._score_batch

    def forward_then_leave(texts):
        forwards.append(texts)
        cancelled.set()  # the caller leaves during the first micro-batch
        return real(texts)

    rm._score_batch = forward_then_leave
    with pytest.raises(ScoringCancelled, match="after 1 of 4 samples"):
        rm.score(PROMPTS, RESPONSES, cancelled)
    assert len(forwards) == 1
    with pytest.raises(ScoringCancelled, match="after 0 of 4"):
        rm.score(PROMPTS, RESPONSES, cancelled)  # set before the call: no forward at all
    assert len(forwards) == 1


SLOW_FORWARD_S = 0.2


@pytest.fixture
def slow_rm_scorer(seq_rm):
    """A scorer whose reward model takes SLOW_FORWARD_S a micro-batch of one sample (as a
    large model would); `forwards` counts the micro-batches run."""
    cfg = RewardConfig(
        num_workers=1,
        reward_model=RewardModelConfig(enable=True, path=str(seq_rm), micro_batch_size=1),
    )
    with RewardScorer(cfg) as scorer:
        real = scorer.reward_model._score_batch
        scorer.forwards = 0

        def slow(texts):
            scorer.forwards += 1
            time.sleep(SLOW_FORWARD_S)
            return real(texts)

        scorer.reward_model._score_batch = slow
        yield scorer


def _items(n: int) -> list[ScoreItem]:
    return [ScoreItem("Dahoas/full-hh-rlhf", f"reply {i}", "", prompt="Q: hi") for i in range(n)]


class _Caller:
    """A Score call on a thread, with the `when_caller_leaves` hook a gRPC server passes."""

    def __init__(self, scorer: RewardScorer, n: int):
        self.leave_fns: list = []
        self.out = None
        self.thread = threading.Thread(
            target=lambda: setattr(self, "out", scorer.score(_items(n), None, self._register))
        )
        self.thread.start()

    def _register(self, fn) -> bool:
        self.leave_fns.append(fn)
        return True

    def leave(self) -> float:
        """Runs the callbacks as the RPC's end would; how long the call then took to return."""
        t0 = time.monotonic()
        for fn in self.leave_fns:
            fn()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return time.monotonic() - t0


def _wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_caller_that_leaves_stops_its_reward_model_batch(slow_rm_scorer):
    """Before, the model scored the whole batch for nobody (40 x 0.2 s here), and every
    other call waited behind it."""
    call = _Caller(slow_rm_scorer, 40)
    _wait_for(lambda: slow_rm_scorer.forwards >= 2)
    took = call.leave()
    assert took < 10 * SLOW_FORWARD_S
    assert slow_rm_scorer.forwards < 10
    assert [o.reason for o in call.out] == [CANCELLED_REASON] * 40
    assert not any(o.ok for o in call.out)
    # the model is free again: the next call is scored, in full
    out = slow_rm_scorer.score(_items(2))
    assert all(o.ok and "rm_score" in o.extra for o in out)


def test_a_caller_that_leaves_while_waiting_for_the_model_gives_up_at_once(slow_rm_scorer):
    first = _Caller(slow_rm_scorer, 80)  # 80 forwards of 0.2 s: 16 s
    _wait_for(lambda: slow_rm_scorer.forwards >= 1)
    second = _Caller(slow_rm_scorer, 3)
    time.sleep(2 * SLOW_FORWARD_S)
    # It never waits for the first call's batch, which has more than 15 s left.
    assert second.leave() < 5.0
    assert [o.reason for o in second.out] == [CANCELLED_REASON] * 3
    assert first.thread.is_alive()  # the first call goes on
    first.leave()


def test_abandon_stops_the_reward_model_calls_under_way(slow_rm_scorer):
    """A stopping server: the calls on the model return within one micro-batch."""
    call = _Caller(slow_rm_scorer, 40)
    _wait_for(lambda: slow_rm_scorer.forwards >= 1)
    t0 = time.monotonic()
    slow_rm_scorer.abandon()
    call.thread.join(30)
    assert time.monotonic() - t0 < 10 * SLOW_FORWARD_S
    assert [o.reason for o in call.out] == [CANCELLED_REASON] * 40
    late = slow_rm_scorer.score(_items(1))  # a call after the stop starts nothing
    assert late[0].reason == CANCELLED_REASON and slow_rm_scorer.forwards < 10


# --- a path that is no reward model: a config error naming the key, and saying why ---------


def _rm_error(path, **kwargs) -> str:
    with pytest.raises(RewardModelError) as e:
        RewardModel(str(path), device="cpu", **kwargs)
    assert e.value.key == "reward.reward_model.path"
    return str(e.value)


def test_a_path_that_does_not_exist_names_the_key(tmp_path):
    """Before: `OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name':
    '/tmp/nope'` (INTERNAL at Initialize, exit 1)."""
    missing = tmp_path / "nope"
    assert _rm_error(missing) == (
        f"reward.reward_model.path: {missing} does not exist "
        "(a Hugging Face model folder with a classification head is needed)"
    )


def test_a_folder_without_config_or_weights_names_the_key(tmp_path, seq_rm):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _rm_error(empty) == (
        f"reward.reward_model.path: {empty} has no config.json "
        "(a Hugging Face model folder with a classification head is needed)"
    )
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((seq_rm / name).read_bytes())
    message = _rm_error(no_weights)  # transformers' OSError, with the key in front
    assert message.startswith(f"reward.reward_model.path: {no_weights} cannot be loaded: ")
    assert "model.safetensors" in message


def test_a_hub_id_that_cannot_be_loaded_says_so(monkeypatch):
    """A name of the Hub's form goes to transformers (hub ids keep working); its failure is
    named with the key."""

    def offline(path, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(reward_model.AutoConfig, "from_pretrained", offline)
    assert _rm_error("someone/some-rm") == (
        "reward.reward_model.path: someone/some-rm does not exist, and loading it as a Hugging "
        "Face Hub id failed: We couldn't connect to 'https://huggingface.co' to load the files "
        "(a Hugging Face model folder with a classification head is needed)"
    )


def test_a_hub_id_that_loads_still_works(monkeypatch, seq_rm):
    """transformers resolves a Hub id itself (from its cache here): no check of ours stands in
    the way of one that it can load."""
    asked = []
    for cls in ("AutoConfig", "AutoModelForSequenceClassification", "AutoTokenizer"):
        auto = getattr(reward_model, cls)
        load = auto.from_pretrained.__func__

        def from_hub(klass, path, *args, _load=load, **kwargs):
            if path == "someone/tiny-rm":
                asked.append(klass.__name__)
                path = str(seq_rm)
            return _load(klass, path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(from_hub))
    rm = RewardModel("someone/tiny-rm", device="cpu")
    assert {"AutoConfig", "AutoModelForSequenceClassification", "AutoTokenizer"} <= set(asked)
    assert rm.path == "someone/tiny-rm" and len(rm.score(PROMPTS[:2], RESPONSES[:2])) == 2


def test_a_causal_lm_is_named_as_one(tmp_path):
    """Before: `reward model X has 2 labels; one is needed` (2 is only transformers' default
    num_labels for a config that sets none)."""
    lm = make_tiny_model_dir(tmp_path / "lm", hidden=32, intermediate=64)
    assert _rm_error(lm) == (
        f"reward.reward_model.path: {lm} is a LlamaForCausalLM (a language model); a reward "
        "model needs a sequence- or token-classification head with one label (num_labels=1)"
    )


def test_a_classification_model_of_two_labels_is_refused(tmp_path):
    path = tmp_path / "two"
    tok = save_char_tokenizer(path)
    config = tiny_llama_config(len(tok), hidden=32, layers=2, heads=2, intermediate=64)
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(str(path))
    assert _rm_error(path) == (
        f"reward.reward_model.path: {path} has 2 labels; one is needed (num_labels=1)"
    )


def test_initialize_refuses_a_missing_reward_model_as_a_config_error(tmp_path):
    """What Initialize builds: a ValueError naming the key (INVALID_ARGUMENT, exit 2)."""
    cfg = RewardConfig(
        num_workers=1,
        reward_model=RewardModelConfig(enable=True, path=str(tmp_path / "nope")),
    )
    with pytest.raises(ValueError, match=r"^reward.reward_model.path: .*nope does not exist"):
        RewardScorer(cfg)


# --- padding: transformers' inputs_embeds warning, and a config without a pad id --------------


@pytest.fixture(scope="module")
def pad_is_eos_rm(tmp_path_factory):
    """A reward model whose config has no pad id and whose tokenizer pads with eos."""
    path = tmp_path_factory.mktemp("pad_is_eos_rm")
    tok = build_char_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(str(path))
    config = tiny_llama_config(len(tok), hidden=32, layers=2, heads=2, intermediate=64)
    config.num_labels = 1
    config.pad_token_id = None
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(str(path))
    return path


def last_token_score(rm: RewardModel, prompt: str, response: str) -> float:
    """The head on the last token's hidden state: no padding, no pad-id search."""
    ids = rm.tokenizer(rm.render(prompt, response), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hidden = rm.model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return float(rm.model.score(hidden[:, -1])[0, 0])


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings():
    """The messages logged by transformers' sequence-classification head (after any filter
    on its logger); warning_once's memory of earlier tests is cleared."""
    logger = logging.getLogger("transformers.modeling_layers")
    records = _Records()
    logger.addHandler(records)
    logging.Logger.warning_once.cache_clear()
    yield records.messages
    logger.removeHandler(records)
    logging.Logger.warning_once.cache_clear()


def test_scores_are_the_last_tokens_without_transformers_padding_warning(
    pad_is_eos_rm, transformers_warnings
):
    """Before: "LlamaForSequenceClassification will not detect padding tokens in
    `inputs_embeds`" at the first batch. The head reads position -1, the real last token
    under left padding, even where a sequence ends with the pad id (here pad == eos, and a
    response ends with eos: transformers' own search for the last non-pad token would take
    the token before it). A config without a pad id scores batches too (before:
    "Cannot handle batch sizes > 1 if no padding token is defined")."""
    rm = RewardModel(str(pad_is_eos_rm), micro_batch_size=4, device="cpu")
    prompts = [*PROMPTS, "Q: 2+2="]
    responses = [*RESPONSES, "4</s>"]  # ends with the pad id
    assert rm.tokenizer(rm.render(prompts[-1], responses[-1]))["input_ids"][-1] == (
        rm.tokenizer.pad_token_id
    )
    got = rm.score(prompts, responses)
    want = [last_token_score(rm, p, r) for p, r in zip(prompts, responses, strict=True)]
    assert got == pytest.approx(want, abs=1e-5)
    assert not [m for m in transformers_warnings if PAD_WARNING in m]
    # the warning is only ours to drop: the same forward outside RewardModel still logs it
    logging.Logger.warning_once.cache_clear()  # it remembers the (dropped) call of ours
    ids = rm.tokenizer(["Q: 1=", "Q: 12="], padding=True, return_tensors="pt")
    with torch.no_grad():
        rm.model(
            inputs_embeds=rm.model.get_input_embeddings()(ids["input_ids"]),
            attention_mask=ids["attention_mask"],
        )
    assert [m for m in transformers_warnings if PAD_WARNING in m]


def test_padding_warning_is_dropped_for_the_default_rm_too(seq_rm, transformers_warnings):
    """The walkthrough's case: a config with a pad id (the usual one)."""
    rm = RewardModel(str(seq_rm), micro_batch_size=4, device="cpu")
    got = rm.score(PROMPTS, RESPONSES)
    want = [last_token_score(rm, p, r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert got == pytest.approx(want, abs=1e-5)
    assert not [m for m in transformers_warnings if PAD_WARNING in m]
