"""A Hugging Face reward model: one number per (prompt, response).

Sequence classification (``AutoModelForSequenceClassification``, num_labels=1) or token
classification read at the last token. The pair is rendered with the reward model's own
tokenizer and chat template (prompt turns + the response as the assistant turn), truncated
from the left to ``max_length`` (the end of the response is what the head reads), and scored in
micro-batches.

Sequences are left-padded and fed as embeddings, so the head reads position -1, which is the
real last token whatever the pad id is (HF's own pooling looks for the rightmost non-pad id,
which goes wrong when pad == eos and the template ends with eos).
"""

from __future__ import annotations

import json
import logging
import threading

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from meshrl.gpus import gpu_names
from services.reward.types import ScoringCancelled

log = logging.getLogger(__name__)


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
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"reward model {path} has {config.num_labels} labels; one is needed")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        archs = getattr(config, "architectures", None) or []
        self.per_token = any("TokenClassification" in a for a in archs)
        auto = (
            AutoModelForTokenClassification
            if self.per_token
            else AutoModelForSequenceClassification
        )
        self.model = auto.from_pretrained(path, num_labels=1, dtype=dtype).to(self.device).eval()
        self.gpus = gpu_names(self.device)  # for the server's info: the run counts its GPUs
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.path = path
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.num_parameters = sum(p.numel() for p in self.model.parameters())

    def render(self, prompt: str, response: str) -> str:
        messages = prompt_messages(prompt) + [{"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n\n".join(m["content"] for m in messages)

    @torch.no_grad()
    def score(
        self,
        prompts: list[str],
        responses: list[str],
        cancelled: threading.Event | None = None,
    ) -> list[float]:
        """One score per pair, in order.

        ``cancelled``: read before each micro-batch; once set, raises ScoringCancelled (a
        forward under way finishes first: a large batch of a large model stops within one
        micro-batch instead of holding the model for the rest of the batch)."""
        pairs = list(zip(prompts, responses, strict=True))
        out: list[float] = []
        for i in range(0, len(pairs), self.micro_batch_size):
            if cancelled is not None and cancelled.is_set():
                raise ScoringCancelled(f"after {i} of {len(pairs)} samples")
            chunk = pairs[i : i + self.micro_batch_size]  # rendered as it is scored
            out.extend(self._score_batch([self.render(p, r) for p, r in chunk]))
        return out

    def _score_batch(self, texts: list[str]) -> list[float]:
        with_template = bool(getattr(self.tokenizer, "chat_template", None))
        enc = self.tokenizer(
            texts,
            add_special_tokens=not with_template,  # the template wrote them already
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        mask = enc["attention_mask"]  # (b, t), zeros on the left
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as if each sequence were unpadded
        embeds = self.model.get_input_embeddings()(enc["input_ids"])  # (b, t, h)
        logits = self.model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions
        ).logits
        if self.per_token:
            logits = logits[:, -1]  # (b, t, 1) -> (b, 1): left padding puts the last token at -1
        return logits[:, 0].float().tolist()
