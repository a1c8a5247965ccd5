"""A trained role's state in CPU memory between its calls (verl's ``fsdp_config.param_offload``
and ``optimizer_offload``).

On a GPU shared with rollout and the other roles, a trained role's float32 master weights
(4 bytes a parameter) and AdamW moments (8) are most of what it holds while it does nothing:
for a 3B model, 36 GB. With offload, each call copies what it needs to the GPU when it
starts and back when it ends, so the other roles have that memory meanwhile, at the price
of a host-device copy each way per call (at ~10-20 GB/s, about 0.2 s per GB of state).
Gradients need nothing: the optimizer step sets them to None.

Moving works on the FSDP2-sharded module as on a plain one (``FSDPModule`` re-points its
shards after ``Module.to``); the optimizer keeps its parameter objects (``to`` swaps their
data in place), and its moments move as tensors (DTensor shards included).
"""

from __future__ import annotations

import torch
from torch import nn

from services.trainer.fsdp.sharding import reshard


class StateOffload:
    """Where a role's weights and optimizer moments live between calls: on its device, or,
    as the config asks, in CPU memory; :meth:`load` before a call, :meth:`release` after."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        params: bool,
        optimizer_states: bool,
    ):
        # On the CPU there is nowhere else to put them: both are no-ops there.
        on_gpu = device.type == "cuda"
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.params = params and on_gpu
        self.optimizer_states = optimizer_states and on_gpu
        self._params_away = False
        self._states_away = False

    @property
    def enabled(self) -> bool:
        return self.params or self.optimizer_states

    def load(self, with_optimizer: bool) -> None:
        """Brings the weights (and, ``with_optimizer``, the moments) to the device."""
        if self._params_away:
            self.model.to(self.device)
            self._params_away = False
        if with_optimizer and self._states_away:
            _move_optimizer_states(self.optimizer, self.device)
            self._states_away = False

    def release(self) -> None:
        """Sends what the config offloads to CPU memory and gives the freed blocks back to
        the GPU (the caching allocator would keep them for this process otherwise)."""
        if not self.enabled:
            return
        if self.params and not self._params_away:
            reshard(self.model)  # a gathered compute-dtype copy is freed, not moved
            self.model.to("cpu")
            self._params_away = True
        if self.optimizer_states and not self._states_away:
            _move_optimizer_states(self.optimizer, torch.device("cpu"))
            self._states_away = True
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def device_bytes(self) -> int:
        """Bytes of weights and moments on the device now (for tests and metrics)."""
        tensors = [*self.model.parameters()] + [
            v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        return sum(_local(t).numel() * t.element_size() for t in tensors if t.device == self.device)


def _move_optimizer_states(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device != device:
                state[key] = value.to(device, non_blocking=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
