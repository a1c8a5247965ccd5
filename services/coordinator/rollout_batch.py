"""The typed batch one PPO step works on, and its conversion to padded tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged


@dataclass
class RolloutBatch:
    """B prompts × n samples. Row k is sample k % n of prompt k // n."""

    prompts: Ragged  # (B·n rows) prompt token ids, each prompt repeated n times
    responses: Ragged  # (B·n rows) response token ids
    rollout_logprobs: Ragged  # sampling log-probs from the engine
    finish_reasons: list[str]
    group_ids: torch.Tensor  # (B·n,) index of the prompt inside the step
    data_sources: list[str]
    ground_truths: list[str]
    extra_infos: list[dict]
    weight_version: int
    # filled by the phases of the step
    scores: torch.Tensor | None = None  # (B·n,)
    reward_extra: list[dict[str, float]] = field(default_factory=list)
    reward_failed: int = 0  # samples the reward service could not score (they score 0)
    old_logprobs: Ragged | None = None
    ref_logprobs: Ragged | None = None
    values: Ragged | None = None
    baseline_scores: torch.Tensor | None = None  # (B·n,) remax greedy baseline

    def __len__(self) -> int:
        return len(self.responses)

    def response_mask(self) -> torch.Tensor:
        """(b, r) float mask over the right-padded responses."""
        _, mask = self.responses.to_padded()
        return mask.float()

    def reward_items(self, tokenizer, responses: Ragged | None = None) -> list[dict]:
        """Decoded responses with their ground truth, as the reward service takes them."""
        responses = responses if responses is not None else self.responses
        texts = tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
        # a reward model reads the prompt too; rule scorers ignore it
        prompts = tokenizer.batch_decode(self.prompts.tolist(), skip_special_tokens=True)
        return [
            {
                "data_source": ds,
                "response": text,
                "ground_truth": gt,
                "prompt": prompt,
                "extra_info_json": json.dumps(extra, default=str),
            }
            for text, prompt, ds, gt, extra in zip(
                texts, prompts, self.data_sources, self.ground_truths, self.extra_infos, strict=True
            )
        ]


def padded(r: Ragged, width: int) -> torch.Tensor:
    """(b, width) float tensor of a ragged float batch, zero on padding."""
    out, _ = r.to_padded(pad_value=0.0, width=width)
    return out.float()
