"""Sampling filters and draws, with hand-worked numbers; left padding of prompt batches."""

import math

import pytest
import torch

from meshrl.ragged import Ragged
from services.rollout.native.batch import left_pad
from services.rollout.native.sampler import sample, top_k_filter, top_p_filter
from services.rollout.types import SamplingParams

NEG = float("-inf")


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert top_k_filter(logits, 2).tolist() == [[NEG, 3.0, 2.0, NEG]]
    assert top_k_filter(logits, 0) is logits  # off
    assert top_k_filter(logits, -1) is logits
    assert top_k_filter(logits, 4) is logits


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # p = 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it -> keep two tokens.
    kept = top_p_filter(logits, 0.7).isfinite().tolist()
    assert kept == [[True, True, False, False]]
    # p = 0.8 is reached exactly by the first two (mass before the third is 0.8 >= p).
    assert top_p_filter(logits, 0.8).isfinite().tolist() == [[True, True, False, False]]
    # p = 0.81 needs the third as well.
    assert top_p_filter(logits, 0.81).isfinite().tolist() == [[True, True, True, False]]
    # A tiny p still keeps the most likely token; the vocabulary order is preserved.
    shuffled = logits[:, [2, 0, 3, 1]]
    assert top_p_filter(shuffled, 0.01).isfinite().tolist() == [[False, True, False, False]]


def test_draws_follow_the_distribution_and_never_pick_filtered_tokens():
    # Probabilities 0.2 / 0.8 over two live tokens, a third filtered out by top_k.
    logits = torch.tensor([math.log(0.2), math.log(0.8), -5.0]).repeat(20000, 1)
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=1, seed=0)
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=3)
    assert counts[2] == 0
    assert abs(counts[1].item() / 20000 - 0.8) < 0.02
    # Log-probs are of the unfiltered distribution at temperature 1.
    full = logits[0].log_softmax(-1)
    assert torch.allclose(logprobs, full[tokens])


def test_greedy_logprobs_are_at_temperature_one():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logprobs = sample(logits, SamplingParams(temperature=0, max_tokens=1), None)
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 0].item())


def test_temperature_scales_the_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5, top_k=1, max_tokens=1)
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0]
    assert logprobs.item() == pytest.approx((logits / 0.5).log_softmax(-1)[0, 0].item(), abs=1e-6)


def test_left_pad_aligns_prompts_to_the_right():
    ids, mask = left_pad(Ragged.from_lists([[5, 6, 7], [8], [9, 10]]), pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == torch.int64
