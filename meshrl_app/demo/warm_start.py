"""Supervised warm start of the demo's tiny model, before PPO.

PPO cannot find a reward that a random model never earns; a short imitation phase makes
the format (`... #### n<eos>`) likely. The demo stops it early, so that PPO has room to
make the model better: on two-digit addition greedy accuracy sits at 0.05 to 0.2 for a
seed-dependent 200 to 450 iterations, then jumps to about 0.8 within 60 to 80
(docs/learning.md).
A fixed iteration count therefore leaves 0.06 on one seed and 0.9 on another; the warm
start instead stops at the first check where greedy accuracy on a probe of *training*
problems reaches `stop_at_accuracy`. Checks come every `check_every` iterations, so the
stop is a function of the seed alone (never of time) and runs repeat.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshrl.progress_ticker import ProgressTicker
from meshrl_app.demo.arithmetic import addition_problem, prompt_text, solution_text
from services.reward.scorers import gsm8k


@dataclass(frozen=True)
class WarmStart:
    """What a warm start did."""

    iterations: int
    """Supervised iterations run (batches of `batch_size` problems)."""
    losses: list[float]
    """The training loss at each check (every `check_every` iterations) and the last."""
    probe_accuracy: float | None
    """Greedy accuracy on the probe of training problems at the stop; None without a stop."""


@dataclass
class _Progress:
    """Where a warm start stands, read by its progress line from another thread."""

    max_iterations: int
    stop_at_accuracy: float | None
    iteration: int = 0
    checks: list[tuple[int, float, float | None]] = field(default_factory=list)
    """(iteration, loss, probe accuracy or None) of each check."""

    def line(self, elapsed_s: float) -> str:
        text = f"warm start: iteration {self.iteration} of at most {self.max_iterations}"
        if self.checks:
            at, loss, accuracy = self.checks[-1]
            text += f"; at iteration {at}: loss {loss:.3f}"
            if accuracy is not None:
                text += f", greedy accuracy on training problems {accuracy:.2f}"
                text += f" (stops at {self.stop_at_accuracy:.2f})"
        return f"{text} ({elapsed_s:.0f} s)"


def _prompt(tokenizer, a: int, b: int) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(a, b)}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def _encode(tokenizer, a: int, b: int) -> tuple[list[int], int]:
    p_ids = _prompt(tokenizer, a, b)
    r_ids = tokenizer(solution_text(a, b), add_special_tokens=False).input_ids + [
        tokenizer.eos_token_id
    ]
    return p_ids + r_ids, len(p_ids)


@torch.no_grad()
def greedy_accuracy(
    model, tokenizer, problems: list[tuple[int, int]], max_new_tokens: int = 24
) -> float:
    """Share of `problems` whose greedy response the GSM8k scorer (verl's strict) counts
    right: `#### a+b` in its last 300 characters."""
    was_training = model.training
    model.eval()
    prompts = [_prompt(tokenizer, a, b) for a, b in problems]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    # left-padded prompts: (n, width)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=(input_ids != pad).long(),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    right = sum(
        gsm8k.compute_score(t, str(a + b)) == 1.0 for t, (a, b) in zip(texts, problems, strict=True)
    )
    model.train(was_training)
    return right / len(problems)


def warm_start(
    model,
    tokenizer,
    max_iterations: int = 2000,
    stop_at_accuracy: float | None = None,
    check_every: int = 10,
    probe_size: int = 128,
    batch_size: int = 128,
    lr: float = 3e-3,
    label_smoothing: float = 0.0,
    cosine: bool = False,
    seed: int = 0,
    held_out: set | None = None,
    digits: int = 2,
    report: Callable[[str], None] | None = None,
) -> WarmStart:
    """Trains on response tokens only, on problems outside `held_out`, on the device the
    model is on.

    Stops after `max_iterations`, or earlier at the first check where greedy accuracy on
    `probe_size` seeded training problems is at least `stop_at_accuracy`. `cosine` decays
    the learning rate to 0 over `max_iterations` (for a run to convergence); else it is
    constant. `report` (optional) hears every `PROGRESS_EVERY_S` (10 s) the iteration and
    the last check's loss and accuracy: a warm start took 725 s on a loaded machine.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    held_out = held_out or set()

    def draw() -> tuple[int, int]:
        while (p := addition_problem(rng, digits)) in held_out:
            pass
        return p

    probe = [draw() for _ in range(probe_size)] if stop_at_accuracy is not None else []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            0.5 * (1 + math.cos(math.pi * min(i, max_iterations) / max_iterations))
            if cosine
            else 1.0
        ),
    )
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    accuracy = None
    cache: dict[tuple[int, int], tuple[list[int], int]] = {}  # the chat template is slow to render
    it = 0
    progress = _Progress(max_iterations, stop_at_accuracy)
    ticker = ProgressTicker(progress.line, report) if report else contextlib.nullcontext()
    with ticker:
        while it < max_iterations:
            seqs, starts = [], []
            for _ in range(batch_size):
                a, b = draw()
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
            input_ids, labels = input_ids.to(device), labels.to(device)
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
            it += 1
            progress.iteration = it
            if it % check_every == 0 or it == max_iterations:
                losses.append(loss.item())
                if probe:
                    accuracy = greedy_accuracy(model, tokenizer, probe)
                progress.checks.append((it, losses[-1], accuracy))
                if accuracy is not None and stop_at_accuracy is not None:
                    if accuracy >= stop_at_accuracy:
                        break
    model.eval()
    return WarmStart(iterations=it, losses=losses, probe_accuracy=accuracy)
