"""Runs the Hugging Face causal LM: prefill, one decode step, a scoring forward, weight copies.

This is the piece a fast CUDA path (static KV cache, CUDA graphs) replaces later; the
engine only calls these few methods. Position ids always come from the attention mask, so
left padding (generation) and right padding (scoring) give every real token the position
it has when the sequence is alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from meshrl.model_files import naming_bad_weights


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(b, t) 0/1 mask -> (b, t) int64 position ids: 0, 1, ... over the real tokens."""
    return (mask.long().cumsum(dim=-1) - 1).clamp_min(0)


class ModelRunner:
    """Owns the model on its device and runs its forwards under inference mode."""

    def __init__(self, model_path: str, dtype: torch.dtype, device: str | torch.device):
        self.device = torch.device(device)
        self.dtype = dtype
        with naming_bad_weights(model_path):
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        # transformers' .to wrapper is annotated as taking the model
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        # transformers 5.2x renamed `past_key_values` to `cache`; older 5.x (the GPU image's)
        # only knows the first name.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Fills `cache` with left-padded prompts ids/mask (b, P); logits (b, v) after the last token."""
        return self._last_logits(ids, mask, positions_from_mask(mask), cache)

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """One token per row: tokens (b, 1), mask (b, past + 1), positions (b, 1) -> logits (b, v)."""
        return self._last_logits(tokens, mask, positions, cache)

    def _last_logits(self, ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,  # the (b, t, v) logits of a prompt would be wasted memory
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def logits_at(
        self, ids: torch.Tensor, mask: torch.Tensor, columns: torch.Tensor
    ) -> torch.Tensor:
        """A full forward without cache; logits (b, k, v) at the k sequence columns given."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            use_cache=False,
            logits_to_keep=columns,
        )
        return out.logits

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copies each tensor into the parameter or buffer of that name (cast to its dtype and
        device, in place, so nothing holding the model sees a new object); returns how many.

        Tied weights answer to every name they have, so a sender may or may not include
        ``lm_head.weight`` of a model that ties it to the embedding.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        count = 0
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"load_weights: the model has no parameter named {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"the model's is {tuple(target.shape)}"
                )
            target.copy_(tensor)
            count += 1
        return count
