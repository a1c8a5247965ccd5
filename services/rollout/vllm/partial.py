"""Partial rollouts on vLLM: abort at a weight swap, then continue each unfinished response
from its prompt and tokens so far under the new weights (the re-prefill way).

``LLM.generate`` runs its requests to the end, and vLLM's engine core decodes on in its own
process between two reads of its outputs, so there is no token boundary to pause at from
outside. Instead the requests are driven through ``LLM.llm_engine`` (``add_request``,
``step``, ``abort_request``), one request a sample, their outputs read as deltas. When a
swap waits: every unfinished request is aborted (the core handles the abort before the
swap's ``collective_rpc``, both being queued to it in that order), the tokens read so far
are kept as the old version's, the engine is lent to the swap, and each unfinished sample
is added again with its prompt plus its tokens so far, for the tokens it has left. The
swap dropped the prefix cache, so that prompt is prefilled under the new weights: this is
``partial_rollout_kv=recompute``; vLLM cannot keep the old keys/values.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged
from services.rollout.engine import TokenBoundary, check_cancelled
from services.rollout.token_versions import TokenVersions
from services.rollout.types import FinishReason, GenerationResult, SamplingParams
from services.rollout.vllm.mapping import continuation_kwargs, finish_reason, sampled_logprobs


@dataclass
class _Sample:
    """One response, over the requests that made its parts."""

    prompt: list[int]
    kwargs: dict  # vllm.SamplingParams keywords of its first request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: FinishReason | None = None
    part: int = 0  # requests it took so far


def generate_across_swaps(
    llm,
    sampling_params_cls,
    delta_kind,
    prompts: Ragged,
    sample_kwargs: list[dict],
    params: SamplingParams,
    engine_version,
    cancelled: threading.Event | None,
    boundary: TokenBoundary,
) -> GenerationResult:
    """``params.n`` samples of each prompt; ``sample_kwargs[i * n + j]``: the
    ``vllm.SamplingParams`` keywords of sample j of prompt i (n = 1 each, a seed of its own).
    ``sampling_params_cls`` is ``vllm.SamplingParams``, ``delta_kind`` vLLM's
    ``RequestOutputKind.DELTA``; ``engine_version()`` reads the engine's weight version."""
    rows = prompts.tolist()
    samples = [_Sample(rows[k // params.n], kwargs) for k, kwargs in enumerate(sample_kwargs)]
    versions = TokenVersions(len(samples), engine_version())
    tag = uuid.uuid4().hex[:12]
    running: dict[str, int] = {}  # request id -> sample

    def add(k: int) -> None:
        sample = samples[k]
        if len(sample.tokens) >= sample.kwargs["max_tokens"]:
            sample.reason = "length"  # its last tokens came with no finished flag yet
            return
        kwargs = continuation_kwargs(sample.kwargs, len(sample.tokens), sample.part)
        request_id = f"meshrl-{tag}-{k}-{sample.part}"
        sample.part += 1
        prompt = {"prompt_token_ids": sample.prompt + sample.tokens}
        llm.llm_engine.add_request(
            request_id, prompt, sampling_params_cls(**kwargs, output_kind=delta_kind)
        )
        running[request_id] = k

    for k in range(len(samples)):
        add(k)
    steps = 0
    try:
        while running:
            check_cancelled(cancelled, steps)
            if boundary.swap_waiting:
                _swap(llm, boundary, samples, running, versions, engine_version)
                for k in sorted(running.pop(r) for r in list(running)):
                    add(k)
                continue
            for out in llm.llm_engine.step():
                owner = running.get(out.request_id)
                if owner is None:
                    continue  # an aborted request's last output
                _take(samples[owner], out.outputs[0])
                if out.finished:
                    samples[owner].reason = finish_reason(out.outputs[0].finish_reason)
                    del running[out.request_id]
            steps += 1
    finally:
        if running:  # cancelled or failed: nothing of this call may go on decoding
            llm.llm_engine.abort_request(list(running))
    tokens = Ragged.from_lists([s.tokens for s in samples], dtype=torch.int64)
    version, token_versions = versions.result(tokens.lengths)
    return GenerationResult(
        responses=tokens,
        logprobs=Ragged.from_lists([s.logprobs for s in samples], dtype=torch.float32),
        finish_reasons=[s.reason or "length" for s in samples],
        weight_version=version,
        token_versions=token_versions,
    )


def _take(sample: _Sample, completion) -> None:
    """Appends a delta output's new tokens and their log-probs (NaN when none were asked)."""
    ids = [int(t) for t in completion.token_ids]
    sample.tokens += ids
    wanted = sample.kwargs.get("logprobs") is not None
    sample.logprobs += sampled_logprobs(ids, completion.logprobs, wanted)


def _swap(llm, boundary, samples, running, versions: TokenVersions, engine_version) -> None:
    """Aborts the running requests, lends the engine to the swap, notes where each sample
    was. The running requests stay in ``running`` (the caller adds them again)."""
    llm.llm_engine.abort_request(list(running))
    if not boundary.lend_if_asked():
        return
    version = engine_version()
    if versions.changed_to(version):
        generated = torch.tensor([len(s.tokens) for s in samples], dtype=torch.int64)
        versions.switch(version, generated)
