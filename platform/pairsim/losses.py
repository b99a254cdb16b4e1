"""Pair-similarity losses over the global batch of all workers.

Distributed gathering lives in :func:`gather_features` only. As open_clip's ``ClipLoss`` with
``gather_with_grad``, features are all-gathered with autograd so gradients flow back to the
worker that produced each one; ``local_loss`` scores only this worker's rows against all
columns (memory O(B_local × B_global)). With the data-parallel gradient average that
DeepSpeed applies, both give exactly the gradient of the loss on the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def gather_features(image: torch.Tensor, text: torch.Tensor, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every worker's features concatenated in rank order ([B_global, d] each), with gradient.

    The autograd all-gather's backward reduce-scatters (sums) the gradient of each slice back
    to the worker that produced it.
    """
    if world_size == 1:
        return image, text
    return (funcol.all_gather_tensor_autograd(image, 0, dist.group.WORLD),
            funcol.all_gather_tensor_autograd(text, 0, dist.group.WORLD))


def unified_rows(sim: torch.Tensor, target: torch.Tensor, margin: float, gamma: float,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row Unified loss for one retrieval direction.

    ``sim`` [R, C]; ``target`` [R] the column of each row's anchor pair; ``positives`` an
    optional bool [R, C] of further positives, never counted as negatives. Returns [R]:

        (1/γ) · log(1 + Σ_{j ∉ P(r)} exp(γ(s_rj − s_r,target + m)))

    computed as a logsumexp over [0, γ(s_rj − s_r,target + m)], finite in float32 up to γ = 1000.
    """
    rows = torch.arange(sim.shape[0], device=sim.device)
    anchor = sim[rows, target]
    logits = gamma * (sim - anchor[:, None] + margin)
    not_negative = torch.zeros_like(sim, dtype=torch.bool)
    not_negative[rows, target] = True
    if positives is not None:
        not_negative |= positives
    logits = logits.masked_fill(not_negative, float("-inf"))
    zero = torch.zeros_like(anchor)[:, None]
    return torch.logsumexp(torch.cat([zero, logits], dim=1), dim=1) / gamma


def unified_loss(sim: torch.Tensor, margin: float, gamma: float,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """Unified loss of pair similarity optimisation (Li et al., arXiv 2209.13869), eq. (5).

    (1/B) Σ_i (1/γ)[ log(1 + Σ_{j∉P(i)} e^{γ(s_ij − s_ii + m)}) + log(1 + Σ_{j∉P'(i)} e^{γ(s_ji − s_ii + m)}) ]

    ``sim[i, j]`` = cos(image i, text j), [B, B]; both directions summed, mean over anchors.
    m = 0 gives InfoNCE/VLC divided by γ; γ → ∞ gives the hardest-negative triplet loss (VSE++).
    """
    target = torch.arange(sim.shape[0], device=sim.device)
    i2t = unified_rows(sim, target, margin, gamma, positives)
    t2i = unified_rows(sim.T, target, margin, gamma, None if positives is None else positives.T)
    return i2t.mean() + t2i.mean()


class UnifiedLoss(nn.Module):
    """Unified loss over the global batch of image/text embeddings.

    Paper: Li et al., "Unified Loss of Pair Similarity Optimization for Vision-Language
    Retrieval", arXiv 2209.13869. Defaults m = 0.2, γ = 50 (the paper's CLIP fine-tuning).
    Limits: m = 0 is InfoNCE with logit scale γ (divided by γ); γ → ∞ is Triplet-HN.
    Features are cast to float32, so bf16 models keep an fp32 loss.

    Args:
        margin: m ≥ 0.
        gamma: γ > 0.
        local_loss: score only this worker's rows (images and texts) against the global batch.
    """

    def __init__(self, margin: float = 0.2, gamma: float = 50.0, *, local_loss: bool = False,
                 rank: int = 0, world_size: int = 1):
        super().__init__()
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.margin, self.gamma = margin, gamma
        self.local_loss = local_loss
        self.rank, self.world_size = rank, world_size

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        image, text = F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1)
        all_image, all_text = gather_features(image, text, self.world_size)
        if not self.local_loss:
            return unified_loss(all_image @ all_text.T, self.margin, self.gamma)
        target = torch.arange(image.shape[0], device=image.device) + self.rank * image.shape[0]
        i2t = unified_rows(image @ all_text.T, target, self.margin, self.gamma)
        t2i = unified_rows(text @ all_image.T, target, self.margin, self.gamma)
        return i2t.mean() + t2i.mean()
