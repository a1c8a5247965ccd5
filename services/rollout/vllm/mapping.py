"""Pure mappings between meshrl's rollout types and vLLM's (no vllm import; unit-tested
on any machine with stand-ins shaped like vLLM's outputs)."""

from __future__ import annotations

from typing import Any, cast

import torch
from google.protobuf import json_format

from meshrl.api.v1 import common_pb2
from meshrl.ragged import Ragged
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.types import FinishReason, SamplingParams


def sampling_kwargs(params: SamplingParams, eos_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one of our requests.

    ``eos_ids``: the model's end-of-sequence ids. vLLM started without a tokenizer
    (``skip_tokenizer_init``) knows no EOS, so they stop a response as stop tokens do, and
    like the native engine's EOS they end it as its last token.

    ``logprobs=0`` asks for the sampled token's log-prob only; with the engine built with
    ``logprobs_mode="processed_logprobs"`` it is taken after temperature (and top-k/top-p,
    which PPO leaves off), like the native engine's ``log_softmax(logits / T)``.
    """
    kwargs: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,  # 0 = greedy in vLLM too
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1 = off in every vLLM version
        "max_tokens": params.max_tokens,
        "logprobs": 0,
        "stop_token_ids": sorted(set(params.stop_token_ids) | set(eos_ids)),
        "detokenize": False,  # token ids are the product; text is the coordinator's job
    }
    if params.seed is not None:
        kwargs["seed"] = params.seed
    return kwargs


PROMPT_SEED_SPREAD = 0x9E3779B97F4A7C15  # odd: distinct request seeds stay distinct mod 2^63


def per_prompt_kwargs(
    params: SamplingParams, num_prompts: int, eos_ids: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """``vllm.SamplingParams`` keywords for each prompt of a request: a seed of its own each.
    vLLM seeds a generator per request, so one seed for all would draw the same noise for
    every prompt (and the very same samples for a prompt given twice). The request's seed is
    spread by a large odd multiplier first: with ``seed + i`` alone, prompt i of the next
    step (whose seed is one more) would reuse prompt i + 1's stream."""
    kwargs = sampling_kwargs(params, eos_ids)
    if params.seed is None:
        return [kwargs] * num_prompts
    base = (params.seed * PROMPT_SEED_SPREAD) % 2**63
    return [{**kwargs, "seed": (base + i) % 2**63} for i in range(num_prompts)]


def per_sample_kwargs(
    params: SamplingParams, num_prompts: int, eos_ids: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """``vllm.SamplingParams`` keywords for each sample, one request a sample (partial
    rollouts): sample j of prompt i at ``i * n + j``, n = 1 each, seeded as
    :func:`per_prompt_kwargs` seeds prompts (with n = 1, the same seeds)."""
    one = SamplingParams(**{**params.__dict__, "n": 1})
    return per_prompt_kwargs(one, num_prompts * params.n, eos_ids)


CONTINUATION_SEED_SPREAD = 0xD1B54A32D192ED03  # odd, and unlike PROMPT_SEED_SPREAD


def continuation_kwargs(kwargs: dict[str, Any], done: int, part: int) -> dict[str, Any]:
    """The keywords of part ``part`` of a sample (0: its first request) that has ``done``
    tokens already: the tokens it has left, and a seed of its own for each part (the same
    seed again would replay the first part's noise over the new prefix)."""
    out = {**kwargs, "max_tokens": kwargs["max_tokens"] - done}
    if part and "seed" in kwargs:
        out["seed"] = (kwargs["seed"] + part * CONTINUATION_SEED_SPREAD) % 2**63
    return out


def scoring_kwargs() -> dict[str, Any]:
    """``vllm.SamplingParams`` keywords that score a prompt: one token out, the log-prob of
    every prompt token (``prompt_logprobs=0``: the actual token's only)."""
    return {"n": 1, "temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}


def token_prompts(prompts: Ragged) -> list[dict[str, list[int]]]:
    """Ragged prompt ids -> vLLM's ``TokensPrompt`` dicts, one per row."""
    return [{"prompt_token_ids": [int(t) for t in row]} for row in prompts.tolist()]


def results_from_outputs(
    outputs: list, n: int
) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
    """vLLM ``RequestOutput`` list (one per prompt) -> token rows, log-prob rows, reasons.

    Row ``i*n + j`` is sample j of prompt i (vLLM numbers the n samples with ``index``).
    """
    tokens, logprobs, reasons = [], [], []
    for request in outputs:
        samples = sorted(request.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, not {n}")
        for sample in samples:
            ids = [int(t) for t in sample.token_ids]
            tokens.append(ids)
            logprobs.append(sampled_logprobs(ids, sample.logprobs))
            reasons.append(finish_reason(sample.finish_reason))
    return tokens, logprobs, reasons


def response_logprobs(
    prompt_logprobs: list, prompt_ids: list[int], response_len: int
) -> list[float]:
    """The log-probs of the last ``response_len`` tokens of a scored sequence, from vLLM's
    ``prompt_logprobs`` (one dict per position, None for the first)."""
    start = len(prompt_ids) - response_len
    return [
        float(prompt_logprobs[pos][prompt_ids[pos]].logprob)
        for pos in range(start, len(prompt_ids))
    ]


def sampled_logprobs(ids: list[int], per_position) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position dicts (``logprobs=0``)."""
    if per_position is None or len(per_position) != len(ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    return [float(per_position[i][tok].logprob) for i, tok in enumerate(ids)]


def finish_reason(reason: str | None) -> FinishReason:
    """vLLM's finish reason of a sample; an aborted one is an error, never a response."""
    if reason in ("stop", "length"):
        return cast(FinishReason, reason)
    raise RuntimeError(f"vLLM finished a sample with reason {reason!r} (aborted?)")


def spec_to_json(spec: GroupSpec) -> str:
    return json_format.MessageToJson(spec.to_proto())


def spec_from_json(text: str) -> GroupSpec:
    return GroupSpec.from_proto(json_format.Parse(text, common_pb2.WeightGroupSpec()))


def manifest_to_json(manifest: WeightManifest) -> str:
    return json_format.MessageToJson(manifest.to_proto())


def manifest_from_json(text: str) -> WeightManifest:
    return WeightManifest.from_proto(json_format.Parse(text, common_pb2.WeightManifest()))


def flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([v for row in rows for v in row], dtype=torch.float32)
