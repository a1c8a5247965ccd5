"""Model (+ optimizer) checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes its own shards; DCP records the global layout, so a checkpoint saved by
N ranks loads into any number of ranks (it reshards on load). A small ``meta.json`` beside
the shards carries the role's own counters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from services.trainer.fsdp.sharding import reshard

META_FILE = "meta.json"


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict | None = None,
) -> None:
    """Writes the model's (and optimizer's) state under ``path``; collective over ranks."""
    Path(path).mkdir(parents=True, exist_ok=True)
    reshard(model)  # the float32 masters, whatever a forward left gathered
    state: STATE_DICT_TYPE
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=str(path))
    write_meta(path, meta, with_optimizer=optimizer is not None)


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    check: Callable[[dict], None] | None = None,
) -> dict:
    """Restores what ``save_checkpoint`` wrote (resharding as needed); returns its meta.

    ``check(meta)`` may refuse the checkpoint (raise) before anything is loaded."""
    meta = read_meta(path, check, with_optimizer=optimizer is not None)
    reshard(model)  # loads into the float32 masters; a gathered copy would go stale
    try:
        _load(path, model, optimizer)
    except CheckpointException as e:
        # A BaseException, not an Exception: left as it is it would pass every handler up
        # to gRPC's and leave the call unanswered until its deadline.
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} does not fit this role's model: {first}") from None
    return meta


def _load(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    state: STATE_DICT_TYPE
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
    else:
        # get_state_dict gives the optimizer's state its full structure (it initialises
        # an empty one), which DCP then fills in place.
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


def write_meta(path: str | os.PathLike, meta: dict | None, with_optimizer: bool) -> None:
    """Rank 0 writes the checkpoint's ``meta.json`` (after its tensors); every rank returns
    once it exists. Every backend's checkpoints have it."""
    if dist.get_rank() == 0:
        meta = {**(meta or {}), "with_optimizer": with_optimizer}
        (Path(path) / META_FILE).write_text(json.dumps(meta, indent=1))
    dist.barrier()


def read_meta(
    path: str | os.PathLike, check: Callable[[dict], None] | None, with_optimizer: bool
) -> dict:
    """A checkpoint's ``meta.json``, refused before any tensor is read: not a checkpoint,
    ``check(meta)`` raising, or optimizer state asked for that it was saved without."""
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise ValueError(f"{path} is not a trainer checkpoint (no {META_FILE})")
    meta = json.loads(meta_file.read_text())
    if check is not None:
        check(meta)
    if with_optimizer and not meta.get("with_optimizer"):
        raise ValueError(f"{path} was saved without optimizer state")
    return meta
