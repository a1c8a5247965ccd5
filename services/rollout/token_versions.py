"""The weight version of every token of one generate call, for partial rollouts.

A weight swap lands at a token boundary of a generation (``engine_lock.py``): the tokens a
sequence had then were sampled under the old weights, every later one under the new. So the
versions are kept as the points where the weights changed, on the host, and spelled out
token by token only at the end of the call; the decode loop records nothing per step.
"""

from __future__ import annotations

import torch

from meshrl.ragged import Ragged
from services.rollout.engine import WeightsMixedError


class TokenVersions:
    def __init__(self, total: int, version: int):
        """``total`` sequences, whose first tokens are sampled under weights ``version``."""
        self.total = total
        self.first = version
        self._switches: list[tuple[int, torch.Tensor]] = []

    @property
    def current(self) -> int:
        """The version the weights have now."""
        return self._switches[-1][0] if self._switches else self.first

    def changed_to(self, version: int) -> bool:
        """Whether a swap that ran at a token boundary left the weights at another version
        than ``current`` (a sync that failed before touching them, or re-sent the same
        version, did not). WeightsMixedError when it failed half-way (version -1)."""
        if version == -1:
            raise WeightsMixedError(
                f"a weight sync failed half-way during this generation (weights were version "
                f"{self.current}, now a mix of two versions)"
            )
        return version != self.current

    def switch(self, version: int, generated: torch.Tensor) -> None:
        """The weights became ``version`` when sequence i had ``generated[i]`` tokens.

        generated: (total,) int64; a sequence not started yet has 0, a finished one its
        length (or anything larger: no token of it comes after the switch).
        """
        if generated.shape != (self.total,):
            raise ValueError(f"generated must have shape ({self.total},), got {generated.shape}")
        self._switches.append((version, generated.to("cpu", torch.int64)))

    def result(self, lengths: torch.Tensor) -> tuple[int, Ragged | None]:
        """``(weight_version, token_versions)`` of responses of ``lengths`` (total,) tokens,
        as :class:`~services.rollout.types.GenerationResult` carries them: the version of the
        newest tokens, and each token's version (None when all tokens are of one version)."""
        lengths = lengths.to("cpu", torch.int64)
        offsets = torch.zeros(self.total + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        seq = torch.repeat_interleave(torch.arange(self.total), lengths)  # (tokens,)
        index = torch.arange(int(offsets[-1])) - offsets[:-1][seq]  # (tokens,) in its response
        values = torch.full_like(index, self.first)
        newest = self.first
        for version, generated in self._switches:
            later = index >= generated[seq]  # (tokens,) sampled after this switch
            if bool(later.any()):
                values[later] = version
                newest = version
        if bool((values == newest).all()):
            return newest, None
        return newest, Ragged(values, offsets)
