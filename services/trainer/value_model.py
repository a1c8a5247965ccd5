"""The critic's model: a causal LM's decoder (no LM head) and a scalar value head.

Built from the policy's own checkpoint, as verl's critic is: the decoder weights come from
the model folder and the head ``nn.Linear(hidden, 1)`` starts at zero, so the first values
are exactly 0 and the first updates move the head before they move the decoder.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


class ValueModel(nn.Module):
    """``model`` is the Hugging Face decoder (e.g. ``LlamaModel``); ``value_head`` maps its
    last hidden state to one value per position."""

    def __init__(self, decoder: PreTrainedModel):
        super().__init__()
        self.model = decoder
        self.value_head = nn.Linear(decoder.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """(b, t) ids -> (b, t) float32 values, one per position. ``attention_kwargs``
        (e.g. the ``cu_seq_lens_q/k`` of a padding-free row) reach every attention call."""
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **attention_kwargs,
        ).last_hidden_state  # (b, t, h)
        values = self.value_head(hidden.to(self.value_head.weight.dtype))  # (b, t, 1)
        # A reduction rather than squeeze(): FSDP2 warns on (and mishandles in-place ops
        # on) a root output that is a view.
        return values.sum(dim=-1).float()
