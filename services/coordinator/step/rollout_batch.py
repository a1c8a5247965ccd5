"""The typed batch one PPO step works on, and its conversion to padded tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged
from services.reward.types import ScoreItem
from services.rollout.types import FinishReason


@dataclass
class RolloutBatch:
    """B prompts × n samples. Row k is sample k % n of prompt k // n."""

    prompts: Ragged  # (B·n rows) prompt token ids, each prompt repeated n times
    responses: Ragged  # (B·n rows) response token ids
    rollout_logprobs: Ragged  # sampling log-probs from the engine
    finish_reasons: list[FinishReason]
    group_ids: torch.Tensor  # (B·n,) index of the prompt inside the step
    data_sources: list[str]
    ground_truths: list[str]
    extra_infos: list[dict]
    weight_version: int
    # (B·n rows) int64 weight version of each response token, aligned with responses;
    # None: every token is of weight_version
    token_versions: Ragged | None = None
    # filled by the phases of the step
    scores: torch.Tensor | None = None  # (B·n,) the score the advantage sees (shaped)
    reward_scores: torch.Tensor | None = None  # (B·n,) the reward service's, unshaped
    reward_extra: list[dict[str, float]] = field(default_factory=list)
    reward_failed: int = 0  # samples the reward service could not score (they score 0)
    # why it could not score each sample ("" when it did), for the generation dumps
    reward_failures: list[str] = field(default_factory=list)
    # each row's prompt as its dataset row has it (PromptRecord.chat), for a reward model;
    # empty (or a row's ""): the decoded prompt text stands in
    chats: list[str] = field(default_factory=list)
    old_logprobs: Ragged | None = None
    ref_logprobs: Ragged | None = None
    values: Ragged | None = None
    baseline_scores: torch.Tensor | None = None  # (B·n,) remax greedy baseline
    # a multi-turn rollout's (multi_turn.py), aligned with responses; None: single-turn
    loss_mask: Ragged | None = None  # uint8, 1 on the model's tokens, 0 on observations
    turn_rewards: Ragged | None = None  # float, env rewards on each turn's last token
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # multi_turn/*

    def __len__(self) -> int:
        return len(self.responses)

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        """The samples of ``groups`` (in that order), renumbered 0..len(groups)-1: what the
        generation and reward phases filled in, before any later phase ran."""
        position = {g: i for i, g in enumerate(groups)}
        rows = [r for g in groups for r in (self.group_ids == g).nonzero().flatten().tolist()]
        pick = lambda items: [items[r] for r in rows]  # noqa: E731 - one line per field
        return RolloutBatch(
            prompts=self.prompts.select(rows),
            responses=self.responses.select(rows),
            rollout_logprobs=self.rollout_logprobs.select(rows),
            finish_reasons=pick(self.finish_reasons),
            group_ids=torch.tensor(
                [position[g] for g in self.group_ids[rows].tolist()], dtype=torch.int64
            ),
            data_sources=pick(self.data_sources),
            ground_truths=pick(self.ground_truths),
            extra_infos=pick(self.extra_infos),
            weight_version=self.weight_version,
            token_versions=(
                self.token_versions.select(rows) if self.token_versions is not None else None
            ),
            scores=self.scores[rows] if self.scores is not None else None,
            reward_scores=self.reward_scores[rows] if self.reward_scores is not None else None,
            reward_extra=pick(self.reward_extra) if self.reward_extra else [],
            reward_failed=self.reward_failed,
            reward_failures=pick(self.reward_failures) if self.reward_failures else [],
            chats=pick(self.chats) if self.chats else [],
            loss_mask=self.loss_mask.select(rows) if self.loss_mask is not None else None,
            turn_rewards=self.turn_rewards.select(rows) if self.turn_rewards is not None else None,
            rollout_metrics=self.rollout_metrics,
        )

    @staticmethod
    def concat(parts: list[RolloutBatch]) -> RolloutBatch:
        """Generated (and scored) batches one after another, their groups numbered on."""
        group_ids, first = [], 0
        for p in parts:
            group_ids.append(p.group_ids + first)
            first += int(p.group_ids.max()) + 1 if len(p) else 0
        scored = all(p.scores is not None and p.reward_scores is not None for p in parts)
        return RolloutBatch(
            prompts=Ragged.concat([p.prompts for p in parts]),
            responses=Ragged.concat([p.responses for p in parts]),
            rollout_logprobs=Ragged.concat([p.rollout_logprobs for p in parts]),
            finish_reasons=[x for p in parts for x in p.finish_reasons],
            group_ids=torch.cat(group_ids),
            data_sources=[x for p in parts for x in p.data_sources],
            ground_truths=[x for p in parts for x in p.ground_truths],
            extra_infos=[x for p in parts for x in p.extra_infos],
            weight_version=max(p.weight_version for p in parts),
            token_versions=(
                Ragged.concat([p.versions() for p in parts])
                if any(p.token_versions is not None for p in parts)
                else None
            ),
            scores=torch.cat([p.scores for p in parts if p.scores is not None]) if scored else None,
            reward_scores=(
                torch.cat([p.reward_scores for p in parts if p.reward_scores is not None])
                if scored
                else None
            ),
            reward_extra=[x for p in parts for x in p.reward_extra],
            reward_failed=sum(p.reward_failed for p in parts),
            reward_failures=[x for p in parts for x in p.reward_failures],
            chats=[x for p in parts for x in (p.chats or [""] * len(p))],
            loss_mask=_concat_optional([p.loss_mask for p in parts]),
            turn_rewards=_concat_optional([p.turn_rewards for p in parts]),
            rollout_metrics=parts[-1].rollout_metrics,
        )

    def versions(self) -> Ragged:
        """The weight version of each response token, filled from ``weight_version`` where
        ``token_versions`` is None."""
        if self.token_versions is not None:
            return self.token_versions
        ids = self.responses.values
        return self.responses.with_values(torch.full_like(ids, self.weight_version).long())

    def sample_versions(self) -> torch.Tensor:
        """(B·n,) int64 each sample's oldest weight version (of its first token, as a sync
        only makes later tokens newer), ``weight_version`` for an empty response."""
        versions = self.versions()
        oldest = torch.full((len(self),), self.weight_version, dtype=torch.int64)
        for i in range(len(self)):
            row = versions.row(i)
            if row.numel():
                oldest[i] = row.min()
        return oldest

    def response_mask(self) -> torch.Tensor:
        """(b, r) float mask over the right-padded responses: 1 on the tokens the model
        sampled (a multi-turn rollout's observations are 0), where the advantages, returns
        and the final score go."""
        _, mask = self.responses.to_padded()
        if self.loss_mask is not None:
            mask = mask & self.loss_mask.to_padded(pad_value=0)[0].bool()
        return mask.float()

    def padded_turn_rewards(self, width: int) -> torch.Tensor | None:
        """(b, width) the environment's rewards on each turn's last token; None: single-turn."""
        return padded(self.turn_rewards, width) if self.turn_rewards is not None else None

    def reward_items(
        self, tokenizer, responses: Ragged | None = None, *, prompt_as_text: bool = False
    ) -> list[ScoreItem]:
        """Decoded responses with their ground truth, as the reward service takes them.

        The prompt (rule scorers ignore it; a reward model reads it) is the row's chat
        (``chats``), which a reward model renders with its own chat template, as verl's
        ``return_raw_chat`` has it; the policy's rendered prompt, decoded, would reach it as
        one user turn holding the policy's template. ``prompt_as_text``: the decoded prompt
        instead, as the policy read it (the generation files and tables show that)."""
        responses = responses if responses is not None else self.responses
        texts = tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
        prompts = self.chats if self.chats and not prompt_as_text else [""] * len(self)
        if not all(prompts):  # a row without its chat: the decoded text stands in
            decoded = tokenizer.batch_decode(self.prompts.tolist(), skip_special_tokens=True)
            prompts = [chat or text for chat, text in zip(prompts, decoded, strict=True)]
        return [
            ScoreItem(ds, text, gt, prompt, extra)
            for text, prompt, ds, gt, extra in zip(
                texts, prompts, self.data_sources, self.ground_truths, self.extra_infos, strict=True
            )
        ]


def _concat_optional(parts: list[Ragged | None]) -> Ragged | None:
    """The parts one after another; None unless every part has one."""
    if any(p is None for p in parts):
        return None
    return Ragged.concat([p for p in parts if p is not None])


def padded(r: Ragged, width: int) -> torch.Tensor:
    """(b, width) float tensor of a ragged float batch, zero on padding."""
    out, _ = r.to_padded(pad_value=0.0, width=width)
    return out.float()
