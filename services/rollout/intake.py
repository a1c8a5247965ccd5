"""Weight intake of the engines that live in the rollout server's own process (native, fast).

The server's process is the weight-sync group's member: over gloo or NCCL the buckets may
land straight in the engine's tensors (``weight_targets``); over CUDA IPC the actor's ring
buffers are mapped here and each tensor is copied out of them. Generation goes on until the
actor starts sending: only the swap itself holds the engine exclusively, so an actor that
never sends does not stall the rollout. With partial rollouts the swap may land inside a
running generation, at its next token boundary (``engine_lock.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from meshrl.weight_sync.group import WeightGroup
from meshrl.weight_sync.receiver import WeightReceiver
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.engine import IntakeFailed, ReceivedWeights


class InProcessEngine(Protocol):
    """What the intake needs of an engine of this process (the native and fast engines)."""

    weight_version: int

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors into the model by Hugging Face name, as they arrive."""

    def weight_targets(self) -> dict[str, torch.Tensor] | None:
        """The model's own tensors by name, which a sync may receive straight into."""

    def reset_prefix_cache(self) -> None: ...


class InProcessIntake:
    """One formation of the group, as joined by an engine of this process."""

    def __init__(self, engine: InProcessEngine, group):
        self.engine = engine
        self.group = group

    @staticmethod
    def join(engine: InProcessEngine, spec: GroupSpec) -> InProcessIntake:
        """Joins as ``spec.rank``; blocks until every member joined."""
        if spec.transport == "cuda_ipc":  # the actor's GPU is ours: open its buffers
            from meshrl.weight_sync.cuda_ipc import IpcGroup

            return InProcessIntake(engine, IpcGroup.join(spec))
        return InProcessIntake(engine, WeightGroup.join(spec))

    @property
    def group_id(self) -> str:
        return self.group.group_id

    def receive(
        self, manifest: WeightManifest, exclusive: AbstractContextManager
    ) -> ReceivedWeights:
        stream = None
        if manifest.ipc_handles:  # cuda_ipc: views of the actor's ring buffers
            pairs = self.group.receive(manifest)
        else:  # gloo/nccl: buckets may land straight in the engine's weights
            targets = self.engine.weight_targets()
            stream = pairs = WeightReceiver(self.group, manifest, targets)
        received = CountedPairs(pairs)
        try:
            if stream is not None:
                stream.wait_for_sender()  # its header only: nothing written yet
            else:
                received.wait_for_first()
            with exclusive:
                self._swap(manifest, received, stream)
        except Exception as e:
            raise IntakeFailed(
                f"after {received.tensors} of {len(manifest.param_names)} tensors", e
            ) from e
        return ReceivedWeights(received.tensors, received.bytes)

    def _swap(
        self, manifest: WeightManifest, received: CountedPairs, stream: WeightReceiver | None
    ) -> None:
        """Loads every tensor, drops cached prefixes, sets the version. A failure once
        weights were touched leaves version -1 (two versions mixed)."""
        engine = self.engine
        try:
            engine.load_weights(received)
            if received.tensors != len(manifest.param_names):
                raise ValueError(
                    f"the engine took {received.tensors} of the "
                    f"{len(manifest.param_names)} tensors of the manifest"
                )
        except Exception:
            if received.tensors or (stream is not None and stream.wrote_targets):
                engine.weight_version = -1
            raise
        engine.reset_prefix_cache()
        engine.weight_version = manifest.version

    def close(self) -> None:
        self.group.close()


class CountedPairs(Iterable[tuple[str, torch.Tensor]]):
    """Passes (name, tensor) pairs through, counting those the consumer has taken in."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]]):
        self._pairs = iter(pairs)
        self._first: list[tuple[str, torch.Tensor]] = []
        self.tensors = 0
        self.bytes = 0

    def wait_for_first(self) -> None:
        """Blocks until the first pair has arrived (kept for the consumer)."""
        self._first = list(itertools.islice(self._pairs, 1))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in itertools.chain(self._first, self._pairs):
            yield name, tensor
            # Resumed: the consumer has loaded this tensor and asks for the next one.
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
