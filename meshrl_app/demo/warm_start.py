"""Supervised warm start of the demo's tiny model, before PPO.

PPO cannot find a reward that a random model never earns; a short imitation phase makes
the format (`... #### n<eos>`) likely. Label smoothing keeps the policy broad, so sampled
responses are often wrong at first and PPO has something to sharpen (DEMO_NOTES). The
length is a fixed, seeded iteration count, never a time budget, so runs repeat.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from meshrl_app.demo.arithmetic import prompt_text, solution_text


def _encode(tokenizer, a: int, b: int) -> tuple[list[int], int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(a, b)}], add_generation_prompt=True, tokenize=False
    )
    p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    r_ids = tokenizer(solution_text(a, b), add_special_tokens=False).input_ids + [
        tokenizer.eos_token_id
    ]
    return p_ids + r_ids, len(p_ids)


def warm_start(
    model,
    tokenizer,
    iterations: int = 900,
    batch_size: int = 128,
    lr: float = 3e-3,
    label_smoothing: float = 0.1,
    seed: int = 0,
    held_out: set | None = None,
) -> list[float]:
    """Trains on response tokens only; returns the loss curve (one value per 50 iterations)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    held_out = held_out or set()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, iterations) / iterations))
    )
    model.train()
    curve = []
    cache: dict[tuple[int, int], tuple[list[int], int]] = {}  # the chat template is slow to render
    for it in range(iterations):
        seqs, starts = [], []
        while len(seqs) < batch_size:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (a, b) in held_out:
                continue
            if (a, b) not in cache:
                cache[(a, b)] = _encode(tokenizer, a, b)
            ids, start = cache[(a, b)]
            seqs.append(ids)
            starts.append(start)
        width = max(len(s) for s in seqs)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (s, start) in enumerate(zip(seqs, starts, strict=True)):
            input_ids[i, : len(s)] = torch.tensor(s)
            labels[i, start : len(s)] = torch.tensor(s[start:])
        logits = model(
            input_ids=input_ids,
            attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id),
        ).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            label_smoothing=label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if it % 50 == 0 or it == iterations - 1:
            curve.append(loss.item())
    model.eval()
    return curve
