"""The first stage of a step: the batch rollout generated, as a frozen value that the later
phases read and never fill (their outputs are stages of their own: ``step/stages.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.ragged import Ragged
from services.reward.types import ScoreItem
from services.rollout.types import FinishReason, GenerationResult


@dataclass(frozen=True)
class GeneratedBatch:
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
    """The newest weights (a step's number) that sampled any token of the batch."""
    # (B·n rows) int64 weight version of each response token, aligned with responses;
    # None: every token is of weight_version
    token_versions: Ragged | None = None
    # each row's prompt as its dataset row has it (PromptRecord.chat), for a reward model;
    # empty (or a row's ""): the decoded prompt text stands in
    chats: list[str] = field(default_factory=list)
    # a multi-turn rollout's (multi_turn.py), aligned with responses; None: single-turn
    loss_mask: Ragged | None = None  # uint8, 1 on the model's tokens, 0 on observations
    turn_rewards: Ragged | None = None  # float, env rewards on each turn's last token
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # multi_turn/*

    @staticmethod
    def of_prompts(records: list, out: GenerationResult, n: int) -> GeneratedBatch:
        """``out``, rollout's ``n`` responses to each of ``records`` (PromptRecord), beside
        what each record says of its prompt."""
        repeat = [i for i in range(len(records)) for _ in range(n)]
        prompts = Ragged.from_lists([records[i].prompt_ids for i in repeat])
        return GeneratedBatch(
            prompts=prompts,
            responses=out.responses,
            rollout_logprobs=out.logprobs,
            finish_reasons=out.finish_reasons,
            group_ids=torch.tensor(repeat, dtype=torch.int64),
            data_sources=[records[i].data_source for i in repeat],
            ground_truths=[records[i].ground_truth for i in repeat],
            extra_infos=[records[i].extra_info for i in repeat],
            weight_version=out.weight_version,
            token_versions=out.token_versions,
            chats=[records[i].chat for i in repeat],
        )

    def __len__(self) -> int:
        return len(self.responses)

    def group_rows(self, groups: list[int]) -> list[int]:
        """The rows of the samples of ``groups``, group after group in that order."""
        return [r for g in groups for r in (self.group_ids == g).nonzero().flatten().tolist()]

    def select_groups(self, groups: list[int]) -> GeneratedBatch:
        """The samples of ``groups`` (in that order), renumbered 0..len(groups)-1."""
        position = {g: i for i, g in enumerate(groups)}
        rows = self.group_rows(groups)
        pick = lambda items: [items[r] for r in rows]  # noqa: E731 - one line per field
        return GeneratedBatch(
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
            chats=pick(self.chats) if self.chats else [],
            loss_mask=self.loss_mask.select(rows) if self.loss_mask is not None else None,
            turn_rewards=self.turn_rewards.select(rows) if self.turn_rewards is not None else None,
            rollout_metrics=self.rollout_metrics,
        )

    @staticmethod
    def concat(parts: list[GeneratedBatch]) -> GeneratedBatch:
        """Generated batches one after another, their groups numbered on."""
        group_ids, first = [], 0
        for p in parts:
            group_ids.append(p.group_ids + first)
            first += int(p.group_ids.max()) + 1 if len(p) else 0
        return GeneratedBatch(
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
