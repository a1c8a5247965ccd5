"""Model paths that name a Hugging Face hub model (``Qwen/Qwen2.5-0.5B-Instruct``), made
local folders once, before any role server starts.

A run's model keys take a local folder or a hub id, as verl's and transformers' do. A hub
id is fetched by ``huggingface_hub.snapshot_download`` into the hub cache (``HF_HOME``,
``HF_HUB_CACHE``; ``HF_TOKEN`` for gated models) or found there, and the run goes on with
the snapshot's folder in its place: every role server gets a local folder and reads no
network. ``HF_HUB_OFFLINE=1`` reads the cache alone. Weights in formats no server loads
(ONNX, TensorFlow, Flax, GGUF, a Llama's ``original/`` consolidated checkpoint) are left
out of the download.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from meshrl.config import ConfigError, RunConfig

log = logging.getLogger(__name__)

NOT_LOADED = [
    "*.onnx",
    "onnx/*",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "*.gguf",
    "original/*",
]
"""Files of a hub repository no role server reads (``ignore_patterns``)."""


def is_hub_id(value: str) -> bool:
    """Whether ``value`` names a hub model rather than a local folder: no folder or file of
    that name here, not written as a path (``/``, ``./``, ``../``, ``~``), and of the form
    ``org/name`` the hub accepts. A bare name (``gpt2``, the hub's oldest models, now also
    ``openai-community/gpt2``) is read as a local folder: a mistyped folder name must not
    turn into a network call."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not value or value.startswith(("/", "./", "../", "~")) or Path(value).exists():
        return False
    if value.count("/") != 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def local_model_folder(key: str, value: str) -> str:
    """``value`` itself unless it is a hub id; else the local folder of its snapshot,
    downloaded if needed. ConfigError naming ``key`` when it cannot be had."""
    if not is_hub_id(value):
        return value
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(value, ignore_patterns=NOT_LOADED)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        why = (
            "gated: log in (hf auth login) or set HF_TOKEN"
            if isinstance(e, GatedRepoError)
            else "no such model, or a private one without HF_TOKEN"
        )
        raise ConfigError(
            f"{key}={value}: not a folder on this machine, nor a model the Hugging Face hub "
            f"gives ({why})"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"{key}={value}: not a folder on this machine, and the Hugging Face hub model "
                f"{value} is not in the hub cache ({constants.HF_HUB_CACHE}) while "
                f"HF_HUB_OFFLINE=1 forbids downloading it: download it where there is a "
                f"network (hf download {value}), unset HF_HUB_OFFLINE, or name a local folder"
            ) from None
        raise ConfigError(
            f"{key}={value}: not a folder on this machine, and the Hugging Face hub could not "
            f"be reached to download it, nor is it in the hub cache ({constants.HF_HUB_CACHE})"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(
            f"{key}={value}: downloading it from the Hugging Face hub failed: {e}"
        ) from None


def hub_model_keys(cfg: RunConfig) -> list[str]:
    """The config keys of model folders this run loads (a critic's and a reward model's
    only when the run has them)."""
    keys = ["actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path"]
    if cfg.use_critic:
        keys += ["critic.model.path", "critic.model.tokenizer_path"]
    if cfg.reward.reward_model.enable:
        keys.append("reward.reward_model.path")
    return keys


def with_local_models(cfg: RunConfig, say: Callable[[str], None] = log.info) -> RunConfig:
    """``cfg`` with each hub id among its model keys replaced by the folder of its snapshot
    (each id fetched once; ``say`` hears of each before it is fetched); ``cfg`` itself when
    none is a hub id."""
    folders: dict[str, str] = {}
    for key in hub_model_keys(cfg):
        value = _get(cfg, key)
        if not value or not is_hub_id(value):
            continue
        if value not in folders:
            say(f"{key}={value}: fetching the Hugging Face hub model (or finding it in its cache)")
            folders[value] = local_model_folder(key, value)
            log.info("%s=%s: the Hugging Face hub model, at %s", key, value, folders[value])
        cfg = _set(cfg, key, folders[value])
    return cfg


def _get(cfg: RunConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _set(node, key: str, value: str):
    """A copy of the config ``node`` with its dotted ``key`` set (sections copied, not
    changed: the caller's config stays as given)."""
    head, _, rest = key.partition(".")
    if not rest:
        return node.model_copy(update={head: value})
    return node.model_copy(update={head: _set(getattr(node, head), rest, value)})
