"""The trainer backends, by verl's ``strategy``: one entry each, and the one question the
roles ask. A backend builds a role's model from the Hugging Face folder, reads its weights
out under Hugging Face names (weight sync, export), and saves and loads its checkpoints;
the roles' forwards, losses and update loop are the same for all of them. Neither the
server, the rank handlers, the coordinator nor weight sync knows which one a role runs.

Adding one: docs/extending.md, "A trainer backend".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Protocol, cast

import torch
from torch import nn

from meshrl.config.schema import RunConfig
from services.trainer.distributed import World


class TrainerBackend(Protocol):
    """What a backend module defines (``services/trainer/<backend>/backend.py``)."""

    NAME: str  # recorded in a checkpoint's meta.json: another backend refuses to load it

    def policy_model(self, cfg: RunConfig, world: World, trained: bool) -> nn.Module:
        """The actor's (``trained``) or the reference's model, on ``world.device``, called
        as a Hugging Face causal LM (``model(input_ids=..., logits_to_keep=k).logits``)."""
        ...

    def value_model(self, cfg: RunConfig, world: World) -> nn.Module:
        """The critic's: ``model(input_ids=...)`` -> ``(b, t)`` float32 values."""
        ...

    def data_world(self, model: nn.Module, world: World) -> World:
        """The ranks a role's batch is split over, from the model's: ``world`` itself, or
        the data-parallel ranks of a model split over several ranks per share
        (``World.data_parallel``)."""
        ...

    def full_params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor), one at a time; every rank drains it in step."""
        ...

    def full_shapes(self, model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        """Hugging Face names and full shapes, in :meth:`full_params` order."""
        ...

    def save_checkpoint(
        self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: dict
    ) -> None: ...

    def load_checkpoint(
        self,
        path: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        check: Callable[[dict], None] | None = None,
    ) -> dict: ...


# strategy -> the module that implements it, imported on first use: megatron-core is
# imported by the Megatron backend alone, so the FSDP2 path never needs it.
BACKENDS = {
    "fsdp": "services.trainer.fsdp.backend",
    "fsdp2": "services.trainer.fsdp.backend",
    "megatron": "services.trainer.megatron.backend",
}


def trainer_backend(strategy: str) -> TrainerBackend:
    """The backend of a role's ``strategy`` (the config allows only the names above)."""
    try:
        module = importlib.import_module(BACKENDS[strategy])
    except ModuleNotFoundError as e:
        if strategy == "megatron" and (e.name or "").startswith("megatron"):
            raise RuntimeError(
                "strategy=megatron needs megatron-core: pip install 'meshrl[megatron]'"
            ) from e
        raise
    return cast(TrainerBackend, module)
