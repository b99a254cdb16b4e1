"""Cross-modal retrieval metrics: image→text and text→image Recall@K and RSUM.

An image has several captions (5 in COCO, Flickr30K and the shapes data): an image query is a
hit at K if any of its captions is in the top K; a caption query is a hit if its image is.
Ties are broken in favour of the lower key index, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def first_positive_rank(sim: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """1-based rank of each query's best-ranked positive key ([Q] int64; 0 where it has none)."""
    order = torch.sort(sim, dim=1, descending=True, stable=True).indices
    hits = torch.gather(positives, 1, order)
    has_positive = hits.any(dim=1)
    return torch.where(has_positive, hits.int().argmax(dim=1) + 1, torch.zeros_like(has_positive, dtype=torch.long))


def recall_at_k(sim: torch.Tensor, positives: torch.Tensor, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Percent of queries with at least one positive in the top k, for each k.

    ``sim`` [Q, K] scores, ``positives`` bool [Q, K]. Queries without any positive are left out.
    """
    ranks = first_positive_rank(sim, positives)
    ranks = ranks[ranks > 0].double()
    if ranks.numel() == 0:
        raise ValueError("no query has a positive key")
    return {f"R@{k}": float((ranks <= k).double().mean() * 100) for k in ks}


def image_text_retrieval(image_emb: torch.Tensor, image_ids: Sequence[str] | np.ndarray,
                         text_emb: torch.Tensor, text_image_ids: Sequence[str] | np.ndarray,
                         ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """``i2t_R@k``, ``t2i_R@k`` and ``rsum`` (the sum of all of them) from L2-normalised embeddings.

    ``text_image_ids[j]`` names the image that caption j describes.
    """
    image_ids, text_image_ids = np.asarray(image_ids), np.asarray(text_image_ids)
    positives = torch.from_numpy(image_ids[:, None] == text_image_ids[None, :])
    sim = image_emb.float() @ text_emb.float().T
    metrics = {f"i2t_{k}": v for k, v in recall_at_k(sim, positives, ks).items()}
    metrics |= {f"t2i_{k}": v for k, v in recall_at_k(sim.T, positives.T, ks).items()}
    metrics["rsum"] = sum(metrics.values())
    return metrics
