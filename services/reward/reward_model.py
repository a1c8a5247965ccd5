"""A Hugging Face reward model: one number per (prompt, response).

Sequence classification (``AutoModelForSequenceClassification``, num_labels=1) or token
classification read at the last token. The pair is rendered with the reward model's own
tokenizer and chat template (prompt turns + the response as the assistant turn), truncated
from the left to ``max_length`` (the end of the response is what the head reads), and scored in
micro-batches; :meth:`RewardModel.score_pairs` also says which pairs were cut.

Sequences are left-padded and fed as embeddings, so the head reads position -1, which is the
real last token whatever the pad id is (HF's own pooling looks for the rightmost non-pad id,
which goes wrong when pad == eos and the template ends with eos).

Encoder reward models (BERT, RoBERTa, DeBERTa: :data:`FIRST_TOKEN_HEADS`) read the first
token instead, where left padding would put a pad: they get the pair as the two texts of a
text pair (prompt, response), as they are trained (OpenAssistant's DeBERTa reward models),
right-padded, the longer one shortened first when over ``max_length``.

A path that cannot be loaded, or a model without a classification head of one label (a
causal LM), raises RewardModelError naming ``reward.reward_model.path`` and saying why.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import NamedTuple

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from meshrl.gpus import gpu_names
from meshrl.model_files import naming_bad_weights
from services.reward.types import RewardModelError, ScoringCancelled

log = logging.getLogger(__name__)

NEEDED = "a Hugging Face model folder with a classification head is needed"
CLASSIFICATION_HEADS = ("ForSequenceClassification", "ForTokenClassification")
LANGUAGE_MODEL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
"""Architecture names of language models: their config's num_labels (2, transformers'
default) says nothing, and a classification head put on them would be random."""

FIRST_TOKEN_HEADS = frozenset(
    {
        "albert", "bert", "camembert", "data2vec-text", "deberta", "deberta-v2",
        "distilbert", "electra", "ernie", "megatron-bert", "mobilebert", "modernbert",
        "mpnet", "roberta", "roberta-prelayernorm", "roformer", "xlm-roberta",
        "xlm-roberta-xl",
    }
)  # fmt: skip
"""``model_type`` of encoders whose sequence-classification head reads the first token
([CLS]); every other reward model is read at its last token."""

PAD_WARNING = "will not detect padding tokens in `inputs_embeds`"
"""transformers' warning at each first forward of a sequence-classification model given
embeddings (see `_QuietPadWarning`)."""
_in_forward = threading.local()


def prompt_messages(prompt: str) -> list[dict[str, str]]:
    """A ScoreItem's prompt as chat messages: a JSON message list, or plain user text."""
    text = prompt.strip()
    if text.startswith("["):
        try:
            messages = json.loads(text)
        except json.JSONDecodeError:
            messages = None
        if isinstance(messages, list) and all(
            isinstance(m, dict) and "content" in m for m in messages
        ):
            return [
                {"role": str(m.get("role", "user")), "content": str(m["content"])} for m in messages
            ]
    return [{"role": "user", "content": prompt}]


class ScoredPair(NamedTuple):
    score: float
    cut: bool
    """Whether the rendered pair was longer than ``max_length`` and lost tokens (from its
    start; for an encoder's text pair, from the longer text's start)."""


class RewardModel:
    """Scores (prompt, response) pairs with a classification model's single logit."""

    def __init__(
        self,
        path: str,
        *,
        micro_batch_size: int = 16,
        max_length: int = 2048,
        device: str | None = None,
    ):
        config = checked_config(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        archs = getattr(config, "architectures", None) or []
        self.per_token = any("TokenClassification" in a for a in archs)
        auto = (
            AutoModelForTokenClassification
            if self.per_token
            else AutoModelForSequenceClassification
        )
        try:  # the tokenizer first: it fails in a moment, the weights take their time
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise RewardModelError(f"{path}: its tokenizer cannot be loaded: {_one_line(e)}") from e
        try:
            with naming_bad_weights(path):
                model = auto.from_pretrained(path, num_labels=1, dtype=dtype)
        except (OSError, ValueError) as e:
            raise RewardModelError(f"{path} cannot be loaded: {_one_line(e)}") from e
        self.model = model.to(self.device).eval()
        self.gpus = gpu_names(self.device)  # for the server's info: the run counts its GPUs
        self.encoder = getattr(config, "model_type", "") in FIRST_TOKEN_HEADS
        if self.encoder and self.per_token:
            raise RewardModelError(
                f"{path}: a token-classification {config.model_type} is read at its first "
                "token, and scores here are read at the last; use its sequence-"
                "classification head"
            )
        # decoders: the head reads the last position; encoders: the first ([CLS])
        self.tokenizer.padding_side = "right" if self.encoder else "left"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        text_config = self.model.config.get_text_config()
        if text_config.pad_token_id is None:
            # transformers' sequence-classification heads refuse a batch of more than one
            # without a pad id ("Cannot handle batch sizes > 1 if no padding token is
            # defined") when the config has none. Given embeddings, as here, the id only
            # passes that check: the head reads position -1 whatever it is.
            text_config.pad_token_id = self.tokenizer.pad_token_id
        _QuietPadWarning.install(self.model)
        self.path = path
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        positions = getattr(text_config, "max_position_embeddings", None)
        if positions and max_length > positions:
            # past it, learned position tables (BERT's) fail to index and rotary ones run
            # outside what the model was trained on: pairs are cut to what it can read
            log.warning(
                "reward.reward_model.max_length=%d exceeds %s's max_position_embeddings=%d: "
                "pairs are truncated to %d tokens",
                max_length,
                path,
                positions,
                positions,
            )
            self.max_length = positions
        self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def render(self, prompt: str, response: str) -> str:
        messages = prompt_messages(prompt) + [{"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            # tokenize=False gives the text (its annotation: any of its return types)
            return self.tokenizer.apply_chat_template(messages, tokenize=False)  # type: ignore[return-value]
        return "\n\n".join(m["content"] for m in messages)

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        cancelled: threading.Event | None = None,
    ) -> list[float]:
        """One score per pair, in order (see :meth:`score_pairs`)."""
        return [pair.score for pair in self.score_pairs(prompts, responses, cancelled)]

    @torch.no_grad()
    def score_pairs(
        self,
        prompts: list[str],
        responses: list[str],
        cancelled: threading.Event | None = None,
    ) -> list[ScoredPair]:
        """One score per pair, in order, and whether the pair was cut to ``max_length``.

        ``cancelled``: read before each micro-batch; once set, raises ScoringCancelled (a
        forward under way finishes first: a large batch of a large model stops within one
        micro-batch instead of holding the model for the rest of the batch)."""
        pairs = list(zip(prompts, responses, strict=True))
        out: list[ScoredPair] = []
        for i in range(0, len(pairs), self.micro_batch_size):
            if cancelled is not None and cancelled.is_set():
                raise ScoringCancelled(f"after {i} of {len(pairs)} samples")
            chunk = pairs[i : i + self.micro_batch_size]  # rendered as it is scored
            if self.encoder:
                out.extend(self._score_text_pairs(chunk))
            else:
                out.extend(self._score_batch([self.render(p, r) for p, r in chunk]))
        return out

    def _cut(self, enc, *texts: list[str], **kwargs) -> list[bool]:
        """Which rows of ``enc`` (a truncating tokenizer call on ``texts``) lost tokens: a fast
        tokenizer keeps what it cut as each encoding's ``overflowing``; a slow one has no
        encodings, and its rows are tokenized again, whole, to count them."""
        if enc.encodings is not None:
            return [bool(e.overflowing) for e in enc.encodings]
        whole = self.tokenizer(*texts, truncation=False, **kwargs)["input_ids"]
        return [len(ids) > self.max_length for ids in whole]

    def _score_text_pairs(self, pairs: list[tuple[str, str]]) -> list[ScoredPair]:
        """An encoder's scores: (prompt text, response) as a text pair, right-padded, read by
        the model's own head at [CLS]; over ``max_length``, the longer text is shortened
        first, from its start."""
        prompts = ["\n\n".join(m["content"] for m in prompt_messages(p)) for p, _ in pairs]
        responses = [r for _, r in pairs]
        enc = self.tokenizer(
            prompts,
            responses,
            padding=True,
            truncation="longest_first",
            max_length=self.max_length,
            return_tensors="pt",
        )
        cut = self._cut(enc, prompts, responses)
        scores = self.model(**enc.to(self.device)).logits[:, 0].float().tolist()
        return [ScoredPair(*pair) for pair in zip(scores, cut, strict=True)]

    def _score_batch(self, texts: list[str]) -> list[ScoredPair]:
        with_template = bool(getattr(self.tokenizer, "chat_template", None))
        special = not with_template  # the template wrote them already
        enc = self.tokenizer(
            texts,
            add_special_tokens=special,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        cut = self._cut(enc, texts, add_special_tokens=special)
        enc = enc.to(self.device)
        mask = enc["attention_mask"]  # (b, t), zeros on the left
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as if each sequence were unpadded
        embeds = self.model.get_input_embeddings()(enc["input_ids"])  # (b, t, h)
        with _QuietPadWarning.forward():
            logits = self.model(
                inputs_embeds=embeds, attention_mask=mask, position_ids=positions
            ).logits
        if self.per_token:
            logits = logits[:, -1]  # (b, t, 1) -> (b, 1): left padding puts the last token at -1
        scores = logits[:, 0].float().tolist()
        return [ScoredPair(*pair) for pair in zip(scores, cut, strict=True)]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def checked_config(path: str):
    """The config of the reward model at `path`, once it is known to be one: RewardModelError
    otherwise (see `_load_config` and `_check_head`). Quick: no weights are read."""
    config = _load_config(path)
    _check_head(path, config)
    return config


def _load_config(path: str):
    """The model's config, or RewardModelError saying why there is none: a local path that
    does not exist, a folder without config.json, or a name the Hugging Face Hub does not
    give (hub ids still load when transformers can load them)."""
    local = Path(path)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise RewardModelError(f"{path} has no config.json ({NEEDED})")
    elif local.exists():
        raise RewardModelError(f"{path} is a file, not a folder ({NEEDED})")
    elif not _could_be_hub_id(path):  # transformers would say "Repo id must be in the form"
        raise RewardModelError(f"{path} does not exist ({NEEDED})")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        if local.is_dir():
            raise RewardModelError(f"{path}: config.json cannot be read: {_one_line(e)}") from e
        raise RewardModelError(
            f"{path} does not exist, and loading it as a Hugging Face Hub id failed: "
            f"{_one_line(e)} ({NEEDED})"
        ) from e


def _could_be_hub_id(path: str) -> bool:
    """Whether `path` has the form of a Hub id ("name" or "namespace/name")."""
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _check_head(path: str, config) -> None:
    """RewardModelError unless `config` is of a model with one label: a language model
    (its architectures only ...ForCausalLM and the like) is named as one, since its
    num_labels (2, transformers' default) would only mislead."""
    archs = list(getattr(config, "architectures", None) or [])
    with_head = [a for a in archs if a.endswith(CLASSIFICATION_HEADS)]
    if archs and not with_head and all(a.endswith(LANGUAGE_MODEL_HEADS) for a in archs):
        raise RewardModelError(
            f"{path} is a {', '.join(archs)} (a language model); a reward model needs a "
            "sequence- or token-classification head with one label (num_labels=1)"
        )
    labels = getattr(config, "num_labels", 1)
    if labels != 1:
        raise RewardModelError(f"{path} has {labels} labels; one is needed (num_labels=1)")


class _QuietPadWarning(logging.Filter):
    """Drops transformers' "... will not detect padding tokens in `inputs_embeds`" warning,
    and only when our own forward (on this thread) logs it.

    Why it comes: given ``inputs_embeds`` and a config with a pad id, the sequence-
    classification heads cannot look for the last non-pad token, so they read position -1.
    Why it is harmless here: we pad on the left, so position -1 is each row's real last
    token; that is the very reason we pass embeddings. Passing ``input_ids`` instead would
    silence it, but the head would then take the rightmost token that is not the pad id,
    which is wrong whenever a sequence ends with that id (pad == eos, a template ending
    with eos). Leaving the pad id unset would not do either: the head then refuses batches
    of more than one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(_in_forward, "active", False) and PAD_WARNING in record.getMessage())

    @classmethod
    def install(cls, model) -> None:
        """On the loggers of the modules that define `model`'s class and its bases (the
        warning is logged by the module of the forward: modeling_layers for Llama and Qwen,
        modeling_gpt2 for GPT-2); once per logger."""
        for klass in type(model).__mro__:
            if klass.__module__.startswith("transformers."):
                logger = logging.getLogger(klass.__module__)
                if not any(isinstance(f, cls) for f in logger.filters):
                    logger.addFilter(cls())

    @staticmethod
    @contextlib.contextmanager
    def forward():
        _in_forward.active = True
        try:
            yield
        finally:
            _in_forward.active = False
