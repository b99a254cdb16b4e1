"""A base loss registered from outside the package, as a plugin would: a cosine-margin hinge.

A module of its own (not a test module) so that Ray workers, which have tests/ on their path,
import it when they unpickle a config naming it — and the import registers it there too."""

import torch
from pydantic import Field

from pairsim.config import Float, Int, Section
from pairsim.losses import BaseLoss
from pairsim.registry import BASE_LOSSES


@BASE_LOSSES.register("cos_hinge")
class CosineHinge(BaseLoss):
    """Per anchor: the mean over its negatives of [s_neg − s_pos + m]_+ (a triplet loss over
    every negative rather than the hardest)."""

    anchors_only = True

    class Params(Section):
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


@BASE_LOSSES.register("cos_hinge_unstable")
class UnstableCosineHinge(CosineHinge):
    """The hinge, non-finite for margins above 1: a sweep trial whose numerics blow up."""

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        rows = super().rows(sim, targets, ignore)
        return rows * float("nan") if self.cos_margin > 1 else rows


@BASE_LOSSES.register("cos_hinge_nan_after")
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
