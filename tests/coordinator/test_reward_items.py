"""What the coordinator sends the reward service for each sample."""

import json

import torch

from meshrl.ragged import Ragged
from meshrl.testing.char_tokenizer import build_char_tokenizer
from services.coordinator.generation.generated import GeneratedBatch
from services.reward.reward_model import prompt_messages

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Q: 1+2="},
]


def _batch(tok, chats: list[str]) -> GeneratedBatch:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    response = tok("3", add_special_tokens=False)["input_ids"]
    return GeneratedBatch(
        prompts=Ragged.from_lists([prompt]),
        responses=Ragged.from_lists([response]),
        rollout_logprobs=Ragged.from_lists([[0.0] * len(response)]),
        finish_reasons=["stop"],
        group_ids=torch.zeros(1, dtype=torch.int64),
        data_sources=["Dahoas/full-hh-rlhf"],
        ground_truths=[""],
        extra_infos=[{}],
        weight_version=0,
        chats=chats,
    )


def test_a_reward_model_gets_the_rows_messages_not_the_policys_rendered_text():
    """Before, it got the policy's rendered prompt decoded, which it wrapped as one user
    turn: a system message and the policy's template inside the user's words."""
    tok = build_char_tokenizer()
    batch = _batch(tok, [json.dumps(MESSAGES)])
    (item,) = batch.reward_items(tok)
    assert prompt_messages(item.prompt) == MESSAGES
    assert item.response == "3"
    (shown,) = batch.reward_items(tok, prompt_as_text=True)  # what the generation files show
    assert shown.prompt == tok.decode(batch.prompts.tolist()[0], skip_special_tokens=True)


def test_without_the_rows_prompt_the_decoded_text_stands_in():
    tok = build_char_tokenizer()
    batch = _batch(tok, [])
    (item,) = batch.reward_items(tok)
    assert item.prompt == tok.decode(batch.prompts.tolist()[0], skip_special_tokens=True)
    assert item.prompt.endswith("Q: 1+2=")
    chat = json.dumps(MESSAGES)
    empty = _batch(tok, [chat]).select_groups([])  # dynamic sampling: no group kept
    both = GeneratedBatch.concat([_batch(tok, [chat]), empty, _batch(tok, [])])
    assert both.chats == [chat, ""]  # row by row: the row without its own falls back alone
    with_chat, without = both.reward_items(tok)
    assert with_chat.prompt == chat and without.prompt == item.prompt
