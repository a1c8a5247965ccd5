"""Batches of prompts, epoch after epoch, with an exactly resumable position.

Each epoch's order is a permutation drawn from ``torch.Generator().manual_seed(seed + epoch)``,
so the order of epoch e depends only on (seed, e): restoring ``{"epoch", "batch_in_epoch",
"seed"}`` from a checkpoint gives the very batches an uninterrupted run would have seen, as
long as the prompts and the batch size are those of the saved run. The state also records
these two, and a resume with others is logged as a warning: the batches then differ.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Protocol

import torch

from meshrl.data.dataset import PromptRecord

log = logging.getLogger(__name__)


class Records(Protocol):
    """What the loader reads of its dataset: a PromptDataset, or a list of records."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> PromptRecord: ...


class PromptLoader:
    """Serves ``(epoch, batch)`` pairs; a batch is a list of PromptRecord."""

    def __init__(
        self,
        dataset: Records,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        batch_size_key: str = "data.train_batch_size",
    ):
        """``batch_size_key``: the config key that set ``batch_size``, for the error."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size} "
                f"(drop_last=True); lower {batch_size_key} or add data"
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset positions in the order epoch `epoch` serves them."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(n, generator=g).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> tuple[int, list[PromptRecord]]:
        """The batch at the current position, then advance (rolling over to the next epoch)."""
        epoch = self.epoch
        start = self.batch_in_epoch * self.batch_size
        idx = self.epoch_order(epoch)[start : start + self.batch_size]
        self.batch_in_epoch += 1
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch, self.batch_in_epoch = epoch + 1, 0
        return epoch, [self.dataset[i] for i in idx]

    def __iter__(self) -> Iterator[tuple[int, list[PromptRecord]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch to serve, and what the order was drawn over."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "prompts": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (state.get("prompts"), state.get("batch_size"))  # absent in older checkpoints
        now = (len(self.dataset), self.batch_size)
        if saved[0] is not None and saved != now:
            log.warning(
                "resuming over %d prompts in batches of %d, but the checkpoint was saved over "
                "%d prompts in batches of %d: the batches from here differ from the saved run's",
                *now,
                *saved,
            )
        batch = int(state["batch_in_epoch"])
        if not 0 <= batch < self.steps_per_epoch:
            raise ValueError(
                f"batch_in_epoch={batch} is outside this dataset's {self.steps_per_epoch} "
                "batches per epoch (did the data or batch size change?)"
            )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = batch
        self.seed = int(state.get("seed", self.seed))
        self._order_epoch = -1
