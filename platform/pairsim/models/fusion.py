"""Fusion modules: the fused image+text embedding GCL scores (``model.fusion``).

Each maps (image [B, d], text [B, d]) to fused [B, d] and is registered in
:data:`pairsim.registry.FUSIONS` under the name config uses. A model with a native fused
encoder (VISTA-like) registers its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pairsim.registry import FUSIONS


@FUSIONS.register("score_sum")
class ScoreSumFusion(torch.nn.Module):
    """The fused image+text embedding of UniIR's CLIP-SF (score fusion), as GCL uses for dual
    encoders: normalize(normalize(image) + normalize(text))."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return F.normalize(F.normalize(image, dim=-1) + F.normalize(text, dim=-1), dim=-1)
