"""Fusion modules: the fused image+text embedding GCL scores (``model.fusion``).

Each maps the model's image and text outputs [B, d], before the losses' and the evaluation's
L2 normalisation, to a fused [B, d]. :data:`BUILT_IN` maps the names of
:data:`pairsim.config.components.FUSIONS` (``model.fusion``) to them.

The outputs are each tower's un-normalised output (open_clip's ``encode_image`` /
``encode_text``), or the cross-modal heads on its normalised output when
``model.crossmodal_heads`` is on (:class:`pairsim.models.retrieval.RetrievalModel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RawSumFusion(torch.nn.Module):
    """UniIR's CLIP-SF score fusion as its code computes it (Wei et al., ECCV 2024), which GCL
    (Lee et al., NeurIPS 2025) uses for dual encoders: normalize(image + text) of the
    un-normalised outputs, so the tower with the longer output weighs more."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return F.normalize(image + text, dim=-1)


class NormalizedSumFusion(torch.nn.Module):
    """normalize(normalize(image) + normalize(text)): both modalities weigh the same whatever
    their norms (pairsim's default)."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return F.normalize(F.normalize(image, dim=-1) + F.normalize(text, dim=-1), dim=-1)


BUILT_IN: dict[str, type[torch.nn.Module]] = {"raw_sum": RawSumFusion, "normalized_sum": NormalizedSumFusion}
