"""The vLLM rollout engine: ``vllm.LLM`` behind the :class:`RolloutEngine` protocol.

Thin on purpose: generation, prompt log-probs, prefix-cache reset and sleep/wake are
vLLM's own calls; weights arrive through vLLM's extension point for RL trainers, a worker
extension class (``worker_extension_cls``) whose methods run inside vLLM's GPU worker,
driven by ``LLM.collective_rpc``. The worker process itself joins the meshrl weight-sync
group (gloo or NCCL, see docs/weight_sync.md) and loads each bucket's tensors with the
model's own ``load_weights``, which maps Hugging Face names onto vLLM's fused layers.

Nothing here imports vllm at module import: the module (and its pure helpers) load on any
machine, and building the engine without vllm installed fails with a clear message.
Exercised here: only the helpers and that message (vLLM's wheels are CUDA builds; no
machine of this project runs them). See docs/weight_sync.md, "vLLM adapter".
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from google.protobuf import json_format

from meshrl.api.v1 import common_pb2
from meshrl.ragged import Ragged
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.engine import (
    FinishReason,
    GenerationResult,
    MemoryReleasedError,
    SamplingParams,
    TokenScores,
    check_cancelled,
)

log = logging.getLogger(__name__)

EXTENSION_CLS = f"{__name__}.MeshrlWorkerExtension"
"""Fully qualified name vLLM imports in its worker process."""

_RPC_SLACK_S = 30.0


class VllmNotInstalledError(ImportError):
    """rollout.name=vllm on a machine without the vllm package."""


def import_vllm():
    """The vllm package, or a :class:`VllmNotInstalledError` that says what to do."""
    try:
        import vllm
    except ImportError as e:
        raise VllmNotInstalledError(
            "actor_rollout_ref.rollout.name=vllm needs the vllm package, which is not "
            f"installed here ({e}). vLLM ships CUDA builds for GPU nodes: install it there "
            "with `pip install 'meshrl[vllm]'`, or use rollout.name=native (CPU and GPU)."
        ) from e
    return vllm


# --- pure helpers (no vllm needed; unit-tested) ---


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one of our requests.

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
        "stop_token_ids": list(params.stop_token_ids),
        "detokenize": False,  # token ids are the product; text is the coordinator's job
    }
    if params.seed is not None:
        kwargs["seed"] = params.seed
    return kwargs


PROMPT_SEED_SPREAD = 0x9E3779B97F4A7C15  # odd: distinct request seeds stay distinct mod 2^63


def per_prompt_kwargs(params: SamplingParams, num_prompts: int) -> list[dict[str, Any]]:
    """``vllm.SamplingParams`` keywords for each prompt of a request: a seed of its own each.
    vLLM seeds a generator per request, so one seed for all would draw the same noise for
    every prompt (and the very same samples for a prompt given twice). The request's seed is
    spread by a large odd multiplier first: with ``seed + i`` alone, prompt i of the next
    step (whose seed is one more) would reuse prompt i + 1's stream."""
    kwargs = sampling_kwargs(params)
    if params.seed is None:
        return [kwargs] * num_prompts
    base = (params.seed * PROMPT_SEED_SPREAD) % 2**63
    return [{**kwargs, "seed": (base + i) % 2**63} for i in range(num_prompts)]


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
            logprobs.append(_sampled_logprobs(ids, sample.logprobs))
            reasons.append(_finish_reason(sample.finish_reason))
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


def _sampled_logprobs(ids: list[int], per_position) -> list[float]:
    if per_position is None or len(per_position) != len(ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    return [float(per_position[i][tok].logprob) for i, tok in enumerate(ids)]


def _finish_reason(reason: str | None) -> FinishReason:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM finished a sample with reason {reason!r} (aborted?)")


def spec_to_json(spec: GroupSpec) -> str:
    return json_format.MessageToJson(spec.to_proto())


def spec_from_json(text: str) -> GroupSpec:
    return GroupSpec.from_proto(json_format.Parse(text, common_pb2.WeightGroupSpec()))


def manifest_to_json(manifest: WeightManifest) -> str:
    return json_format.MessageToJson(manifest.to_proto())


def manifest_from_json(text: str) -> WeightManifest:
    return WeightManifest.from_proto(json_format.Parse(text, common_pb2.WeightManifest()))


# --- the engine ---


class VllmEngine:
    """A :class:`~services.rollout.engine.RolloutEngine` on ``vllm.LLM`` (one GPU, TP 1).

    Its weight-sync group member is vLLM's worker process, not the rollout server: see
    :meth:`join_weight_group` and :meth:`receive_weights`, which the rollout worker calls
    instead of receiving the buckets itself.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        vllm = import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=1,
            enable_prefix_caching=True,
            enable_sleep_mode=True,  # release_memory / resume_memory
            logprobs_mode="processed_logprobs",  # vLLM >= 0.10.2: after temperature
            worker_extension_cls=EXTENSION_CLS,
        )
        self.weight_version = 0
        self._released = False
        self._timeout_s = 120.0
        self._num_parameters = int(self.llm.collective_rpc("meshrl_num_parameters")[0])
        log.info("vLLM %s engine: %s (%s)", vllm.__version__, model_path, dtype)

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # vLLM sizes and owns it (gpu_memory_utilization); not reported here

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
    ) -> GenerationResult:
        # LLM.generate runs vLLM's loop to the end: a cancelled call is refused before it
        # starts, not stopped half-way.
        check_cancelled(cancelled, 0)
        self._check_memory()
        sampling = [
            self._vllm.SamplingParams(**kwargs)
            for kwargs in per_prompt_kwargs(params, len(prompts))
        ]
        outputs = self.llm.generate(token_prompts(prompts), sampling, use_tqdm=False)
        tokens, logprobs, reasons = results_from_outputs(outputs, params.n)
        return GenerationResult(
            responses=Ragged.from_lists(tokens, dtype=torch.int64),
            logprobs=Ragged.from_lists(logprobs, dtype=torch.float32),
            finish_reasons=reasons,
            weight_version=self.weight_version,
        )

    def compute_logprobs(self, prompts: Ragged, responses: Ragged, temperature: float) -> Ragged:
        return self.score(prompts, responses, temperature, with_entropy=False).logprobs

    def score(
        self, prompts: Ragged, responses: Ragged, temperature: float, with_entropy: bool
    ) -> TokenScores:
        """Log-probs of given responses through vLLM's prompt log-probs (temperature 1, no
        entropy: the actor computes those)."""
        if temperature != 1.0 or with_entropy:
            raise ValueError(
                "the vLLM engine scores at temperature 1 without entropy; ask the actor "
                f"(got temperature={temperature}, with_entropy={with_entropy})"
            )
        self._check_memory()
        rows = [p + r for p, r in zip(prompts.tolist(), responses.tolist(), strict=True)]
        sequences = Ragged.from_lists(rows)
        sampling = self._vllm.SamplingParams(**scoring_kwargs())
        outputs = self.llm.generate(token_prompts(sequences), sampling, use_tqdm=False)
        lengths = responses.lengths.tolist()
        values = [
            response_logprobs(out.prompt_logprobs, row, n)
            for out, row, n in zip(outputs, rows, lengths, strict=True)
        ]
        return TokenScores(responses.with_values(_flat(values)), None)

    def load_weights(self, named_tensors) -> None:
        raise NotImplementedError(
            "the vLLM engine receives weights in its own worker process: use "
            "join_weight_group / receive_weights"
        )

    # --- weight sync, inside vLLM's worker ---

    def join_weight_group(self, spec: GroupSpec) -> None:
        """Has vLLM's worker join the group as ``spec.rank`` (blocks until all joined)."""
        self._timeout_s = spec.timeout_s
        self.llm.collective_rpc(
            "join_weight_group", args=(spec_to_json(spec),), timeout=spec.timeout_s + _RPC_SLACK_S
        )

    def receive_weights(self, manifest: WeightManifest) -> int:
        """Has vLLM's worker receive the manifest's buckets and load them; returns how many
        tensors it loaded. The caller resets the prefix cache and sets the version."""
        self._check_memory()
        deadline = self._timeout_s * max(1, len(manifest.buckets)) + _RPC_SLACK_S
        loaded = self.llm.collective_rpc(
            "receive_weights", args=(manifest_to_json(manifest),), timeout=deadline
        )
        return int(loaded[0])

    def close_weight_group(self) -> None:
        self.llm.collective_rpc("close_weight_group", timeout=_RPC_SLACK_S)

    # --- memory and caches ---

    def release_memory(self) -> None:
        self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
        self._released = True

    def resume_memory(self) -> None:
        self.llm.wake_up()
        self._released = False

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _check_memory(self) -> None:
        if self._released:
            raise MemoryReleasedError("rollout memory is released: resume it first")


def _flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([v for row in rows for v in row], dtype=torch.float32)


class MeshrlWorkerExtension:
    """Mixed into vLLM's GPU worker class (``worker_extension_cls``): ``self`` is the worker,
    with ``self.model_runner.model`` and ``self.device``. Each method runs in the worker
    process when the engine calls ``collective_rpc`` with its name; arguments travel as
    JSON text, so nothing of meshrl's is pickled across.
    """

    def meshrl_num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def join_weight_group(self, spec_json: str) -> str:
        from meshrl.weight_sync.group import WeightGroup

        self.close_weight_group()
        spec = spec_from_json(spec_json)
        self._meshrl_group = WeightGroup.join(spec)
        return spec.group_id

    def receive_weights(self, manifest_json: str) -> int:
        """Receives every bucket and loads it as it arrives; a failure closes the group."""
        from meshrl.weight_sync.receiver import receive_weights

        manifest = manifest_from_json(manifest_json)
        group = getattr(self, "_meshrl_group", None)
        if group is None or (manifest.group_id and manifest.group_id != group.group_id):
            raise RuntimeError(f"no weight group {manifest.group_id!r} joined in this worker")
        loaded = 0

        def counted():
            nonlocal loaded
            for pair in receive_weights(group, manifest, self.device):
                yield pair
                loaded += 1

        try:
            self.model_runner.model.load_weights(weights=counted())
        except Exception:
            self.close_weight_group()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copies are queued on the worker's stream
        return loaded

    def close_weight_group(self) -> None:
        group = getattr(self, "_meshrl_group", None)
        self._meshrl_group = None
        if group is not None:
            group.close()
