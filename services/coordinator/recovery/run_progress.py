"""What a run changes as it goes: its step, its place in the data, its KL coefficient.

One object, shared by reference between the run's parts (the loop, checkpoints, recovery),
so that a resume or a rewind moves them all at once. Never written back into the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrl.algorithms.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from meshrl.config import RunConfig
from meshrl.data.loader import PromptLoader

KLController = FixedKLController | AdaptiveKLController


def new_kl_controller(cfg: RunConfig) -> KLController:
    """The KL controller of ``algorithm.kl_ctrl`` at its starting coefficient."""
    kl = cfg.algorithm.kl_ctrl
    return make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)


@dataclass
class RunProgress:
    """The coordinator's side of a run's progress; a checkpoint keeps ``step``, the loader's
    position and the KL controller (:class:`~services.coordinator.recovery.checkpointing.CoordinatorState`)."""

    kl_ctrl: KLController
    loader: PromptLoader | None = None  # None in an evaluation (trainer.val_only)
    step: int = 0  # the last step completed
    epoch: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)

    def restart(self, cfg: RunConfig) -> None:
        """Back to the very start of the run: step 0, the first batch, a fresh KL coefficient."""
        if self.loader is not None:
            self.loader.load_state_dict({"epoch": 0, "batch_in_epoch": 0, "seed": cfg.data.seed})
        self.kl_ctrl = new_kl_controller(cfg)
        self.step = 0
