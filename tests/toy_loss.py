"""A third-party base loss, as a plugin package ships it: a cosine-margin hinge.

Registered by entry points (group ``pairsim.base_losses``) in
``tests/pairsim_toy_plugin-0.1.dist-info/entry_points.txt``, which ``importlib.metadata`` finds
wherever tests/ is on the path: the test process and the Ray workers. Nothing registers on import."""

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
