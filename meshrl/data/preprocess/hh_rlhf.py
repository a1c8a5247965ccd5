"""Anthropic HH-RLHF (``<subset>/{train,test}.jsonl.gz``: ``chosen``/``rejected`` dialogues) or
Dahoas/full-hh-rlhf (``prompt``/``response``/``chosen``/``rejected``) into verl's ``rl`` rows.

The prompt is the dialogue before the final ``\\n\\nAssistant:`` as a chat list (Human ->
user, Assistant -> assistant; consecutive turns of one speaker merged), style "model" (a reward
model scores it), ground truth = the chosen final response. Anthropic pairs whose dialogues
differ before the final response are skipped: they share no prompt.
"""

from __future__ import annotations

import re
from typing import Any

DATA_SOURCE = "Dahoas/full-hh-rlhf"
SPLIT_MAP = {"train": "train", "test": "test"}
ASSISTANT = "\n\nAssistant:"
_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}


def dialogue_to_chat(dialogue: str) -> list[dict[str, str]]:
    """``"\\n\\nHuman: hi\\n\\nAssistant: hello\\n\\nHuman: bye"`` -> a chat message list."""
    parts = _TURN.split(dialogue)
    messages: list[dict[str, str]] = []
    if parts[0].strip():  # text before the first marker belongs to the user
        messages.append({"role": "user", "content": parts[0].strip()})
    for speaker, content in zip(parts[1::2], parts[2::2], strict=True):
        role, content = _ROLES[speaker], content.strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


def split_pair(rec: dict[str, Any]) -> tuple[str, str, str] | str:
    """(prompt dialogue through the final Assistant marker, chosen, rejected) or a skip reason."""
    chosen, rejected = rec.get("chosen"), rec.get("rejected")
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        return "no chosen/rejected field"
    if isinstance(rec.get("prompt"), str):  # Dahoas: already split
        return rec["prompt"], chosen.strip(), rejected.strip()
    cut = chosen.rfind(ASSISTANT) + len(ASSISTANT)
    if cut < len(ASSISTANT):
        return "no Assistant turn"
    if rejected[:cut] != chosen[:cut] or rejected.rfind(ASSISTANT) + len(ASSISTANT) != cut:
        return "chosen and rejected differ before the final response"
    return chosen[:cut], chosen[cut:].strip(), rejected[cut:].strip()


def convert(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | str:
    pair = split_pair(rec)
    if isinstance(pair, str):
        return pair
    prompt, chosen, rejected = pair
    messages = dialogue_to_chat(prompt.rstrip().removesuffix("Assistant:").rstrip())
    if not messages or messages[-1]["role"] != "user":
        return "prompt does not end with a Human turn"
    return {
        "data_source": DATA_SOURCE,
        "prompt": messages,
        "ability": "alignment",
        "reward_model": {"style": "model", "ground_truth": chosen},
        "extra_info": {"split": split, "index": index, "chosen": chosen, "rejected": rejected},
    }
