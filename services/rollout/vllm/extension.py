"""The worker extension vLLM mixes into its GPU worker (``worker_extension_cls``).

vLLM runs the model in its own worker process; the meshrl weight-sync group is joined there,
so the actor's buckets land next to the model they update: over CUDA IPC when actor and
vLLM share a GPU (the worker maps the actor's ring buffers and copies each tensor out), over
NCCL or gloo otherwise. Each tensor goes through the model's own ``load_weights``, which maps
Hugging Face names onto vLLM's fused layers (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``): directly with vLLM 0.24, and inside vLLM's in-place reload
(``model_runner.reload_weights``) from 0.32 on, which processes each layer again once its
weights are in (the CPU backend packs its linear weights for oneDNN and keeps no plain
weight a direct ``load_weights`` could write into). The engine drives these methods with ``LLM.collective_rpc``; arguments
travel as JSON text, so nothing of meshrl's is pickled across.

This module is imported by vLLM inside its worker process, by name (``EXTENSION_CLS``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from services.rollout.vllm.mapping import manifest_from_json, spec_from_json

if TYPE_CHECKING:
    from meshrl.weight_sync.cuda_ipc import IpcGroup
    from meshrl.weight_sync.group import WeightGroup

EXTENSION_CLS = f"{__name__}.MeshrlWorkerExtension"
"""Fully qualified name vLLM imports in its worker process."""


def process_tied_head(model: torch.nn.Module) -> bool:
    """Runs vLLM's post-load processing of an LM head tied to the input embeddings again;
    returns whether the model has one.

    A tied head loads no weights of its own (a sync sends the embeddings only, and the
    models' loaders skip ``lm_head.`` when tied), so vLLM's in-place reload puts back what
    its processing made of it at start: on the CPU backend, a oneDNN packing of the first
    embeddings (``ParallelLMHead: Failed to load weights`` in vLLM's log). Processed again,
    as the loader processes it, it packs the new ones."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    if weight is None or embed is None or weight is not getattr(embed, "weight", None):
        return False
    quant_method = getattr(head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(head)
    return True


class MeshrlWorkerExtension:
    """``self`` is vLLM's worker, with ``self.model_runner.model`` and ``self.device``."""

    model_runner: Any  # vLLM's worker has these two
    device: torch.device
    _meshrl_group: IpcGroup | WeightGroup | None

    def meshrl_num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())

    def meshrl_join_weight_group(self, spec_json: str) -> str:
        """Joins one formation of the group as the spec's rank; returns its id."""
        self.meshrl_close_weight_group()
        spec = spec_from_json(spec_json)
        if spec.transport == "cuda_ipc":
            from meshrl.weight_sync.cuda_ipc import IpcGroup

            self._meshrl_group = IpcGroup.join(spec)
        else:
            from meshrl.weight_sync.group import WeightGroup

            self._meshrl_group = WeightGroup.join(spec)
        return spec.group_id

    def meshrl_receive_weights(
        self, manifest_json: str, weight_load: str = "load_weights"
    ) -> list[int]:
        """Receives every bucket and loads each tensor as it arrives; returns [tensors,
        bytes] loaded. A failure closes the group (the coordinator forms a new one).

        ``weight_load`` (``mapping.VllmSupport.weight_load``): ``load_weights`` copies each
        tensor into the model's parameters as it comes; ``reload_weights`` runs vLLM's
        in-place reload, which keeps a layer's tensors until the layer is complete, so
        each is copied out of the rotating staging buffers first."""
        manifest = manifest_from_json(manifest_json)
        group = getattr(self, "_meshrl_group", None)
        if group is None or (manifest.group_id and manifest.group_id != group.group_id):
            raise RuntimeError(f"no weight group {manifest.group_id!r} joined in this worker")
        if manifest.ipc_handles:  # views of the actor's ring buffers, on this GPU
            pairs = group.receive(manifest)
        else:
            from meshrl.weight_sync.receiver import receive_weights

            pairs = receive_weights(group, manifest, self.device)
        loaded = [0, 0]

        reload = weight_load == "reload_weights"

        def counted():
            for name, tensor in pairs:
                yield name, tensor.clone() if reload else tensor
                loaded[0] += 1  # resumed: the model has copied this tensor
                loaded[1] += tensor.numel() * tensor.element_size()

        try:
            if reload:
                self.model_runner.reload_weights(
                    weights_iterator=counted(), is_checkpoint_format=True
                )
                process_tied_head(self.model_runner.model)
            else:
                self.model_runner.model.load_weights(weights=counted())
            if loaded[0] != len(manifest.param_names):
                raise ValueError(
                    f"vLLM's model took {loaded[0]} of the {len(manifest.param_names)} "
                    "tensors of the manifest"
                )
        except Exception:
            self.meshrl_close_weight_group()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copies are queued on the worker's stream
        return loaded

    def meshrl_close_weight_group(self) -> None:
        group = getattr(self, "_meshrl_group", None)
        self._meshrl_group = None
        if group is not None:
            group.close()

    def meshrl_weight_checksum(self, names_json: str) -> list[float]:
        """Sum of each named parameter of vLLM's model, as float64 (for checks that a sync
        really changed the served weights)."""
        import json

        params = dict(self.model_runner.model.named_parameters())
        return [float(params[n].detach().double().sum()) for n in json.loads(names_json)]
