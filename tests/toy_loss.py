"""A third-party base loss, as a plugin package ships it: a cosine-margin hinge.

Registered by entry points (group ``pairsim.base_losses``) in
``tests/pairsim_toy_plugin-0.1.dist-info/entry_points.txt``, which ``importlib.metadata`` finds
wherever tests/ is on the path: the test process and the Ray workers. Nothing registers on import."""

import time
from pathlib import Path

import torch
from pydantic import Field

from pairsim.config import BaseLossParams, Float, Int
from pairsim.losses import BaseLoss


class CosineHinge(BaseLoss):
    """Per anchor: the mean over its negatives of [s_neg − s_pos + m]_+ (a triplet loss over
    every negative rather than the hardest)."""

    anchors_only = True

    class Params(BaseLossParams):
        cos_margin: Float = Field(0.3, ge=0.0, le=2.0, description="margin m of the hinge")

    def __init__(self, cos_margin: float = 0.3):
        super().__init__()
        self.cos_margin = cos_margin

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        # anchors_only: targets are one column index per row
        positive = sim.gather(1, targets[:, None])
        negatives = torch.ones_like(sim, dtype=torch.bool).scatter_(1, targets[:, None], False)
        if ignore is not None:
            negatives &= ~ignore
        hinge = (sim - positive + self.cos_margin).clamp(min=0) * negatives
        return hinge.sum(1) / negatives.sum(1).clamp(min=1)


class UnstableCosineHinge(CosineHinge):
    """The hinge, non-finite for margins above 1: a sweep trial whose numerics blow up."""

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        rows = super().rows(sim, targets, ignore)
        return rows * float("nan") if self.cos_margin > 1 else rows


class CosineHingeNanAfter(CosineHinge):
    """The hinge until its ``finite_calls``-th call, non-finite from then on: a run whose
    numerics blow up part way (a fault injected at a known step)."""

    class Params(CosineHinge.Params):
        finite_calls: Int = Field(0, ge=0, description="calls that give finite values")

    def __init__(self, cos_margin: float = 0.3, finite_calls: int = 0):
        super().__init__(cos_margin)
        self.finite_calls, self.calls = finite_calls, 0

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        rows = super().rows(sim, targets, ignore)
        return rows if self.calls <= self.finite_calls else rows * float("nan")


class CosineHingeHeld(CosineHinge):
    """The hinge, which waits (until ``hold_file`` is gone) once ``run_dir`` holds a checkpoint of
    epoch ``hold_from_epoch``: a run held at a known point for a fault to be injected there."""

    class Params(CosineHinge.Params):
        run_dir: str = Field(description="the run's directory, where its checkpoints are")
        hold_file: str = Field(description="the run waits while this file exists")
        hold_from_epoch: Int = Field(1, ge=1, description="the epoch whose checkpoint starts the wait")

    def __init__(self, run_dir: str, hold_file: str, hold_from_epoch: int = 1, cos_margin: float = 0.3):
        super().__init__(cos_margin)
        self.run_dir, self.hold_file, self.hold_from_epoch = Path(run_dir), Path(hold_file), hold_from_epoch

    def reached(self) -> bool:
        from pairsim.train import checkpoints

        for card in self.run_dir.glob(f"checkpoint_*/{checkpoints.CARD_FILE}"):
            try:
                if checkpoints.checkpoint_card(card.parent).epoch >= self.hold_from_epoch:
                    return True
            except (OSError, ValueError):  # being written
                pass
        return False

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        while self.hold_file.exists() and self.reached():
            time.sleep(0.5)
        return super().rows(sim, targets, ignore)
