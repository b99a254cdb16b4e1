"""The evaluation suite every run reports on a split: image↔text, uni-modal (image→image,
text→text) and the 3×3 modality grid over image, text and fused image+text items
(:func:`evaluate_split`), with the metrics of :mod:`pairsim.eval.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pairsim.eval.metrics import Metrics, blocked_retrieval_metrics

MODALITIES = ("image", "text", "fused")
GRID_KS = (1, 5)


@dataclass
class SplitEmbeddings:
    """A split's L2-normalised embeddings: one row per image and one per caption.

    ``labels`` are the images' class labels (−1: unknown); ``*_unimodal`` the uni-modal heads'
    embeddings, when the model has them.
    """

    image: torch.Tensor
    image_ids: np.ndarray
    labels: np.ndarray
    text: torch.Tensor
    text_image_ids: np.ndarray
    caption_index: np.ndarray
    image_unimodal: torch.Tensor | None = None
    text_unimodal: torch.Tensor | None = None

    @classmethod
    def from_batches(cls, batches: Iterable[dict[str, np.ndarray]]) -> SplitEmbeddings:
        """Concatenate :func:`embed_batch` outputs; float columns (the embeddings) become tensors."""
        columns: dict[str, list[np.ndarray]] = {}
        for batch in batches:
            for name, value in batch.items():
                columns.setdefault(name, []).append(value)
        return cls(**{name: torch.from_numpy(np.concatenate(parts)) if parts[0].dtype.kind == "f"
                      else np.concatenate(parts) for name, parts in columns.items()})

    def id_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """Image ids as integers: (per image, per caption)."""
        _, inverse = np.unique(np.concatenate([self.image_ids, self.text_image_ids]).astype(str), return_inverse=True)
        return inverse[:len(self.image_ids)], inverse[len(self.image_ids):]


@dataclass
class EvalReport:
    """Every metric of a split (flat, keyed as logged) and the modality grid ``grid[k][q, key]``
    (R@k in percent, rows and columns in :data:`MODALITIES` order)."""

    metrics: Metrics
    grid: dict[int, np.ndarray]


def _prefixed(prefix: str, metrics: Metrics) -> Metrics:
    return {f"{prefix}_{k}": v for k, v in metrics.items()}


def crossmodal_metrics(emb: SplitEmbeddings, ks: Sequence[int], **blocks) -> Metrics:
    """Image→text (each caption of the image a positive) and text→image, and ``rsum``: the sum
    of both directions' R@k."""
    image_label, text_label = emb.id_labels()
    i2t = blocked_retrieval_metrics(emb.image, emb.text, image_label, text_label, ks, **blocks)
    t2i = blocked_retrieval_metrics(emb.text, emb.image, text_label, image_label, ks, **blocks)
    return _prefixed("i2t", i2t) | _prefixed("t2i", t2i) | {"rsum": sum(i2t[f"R@{k}"] + t2i[f"R@{k}"] for k in ks)}


def unimodal_metrics(emb: SplitEmbeddings, ks: Sequence[int], **blocks) -> Metrics:
    """Text→text (positives: the other captions of the same image) and, when the split has class
    labels, image→image (positives: the other images of the same class), each query's own key
    left out; with the uni-modal heads' embeddings when the model has them."""
    image = emb.image if emb.image_unimodal is None else emb.image_unimodal
    text = emb.text if emb.text_unimodal is None else emb.text_unimodal
    _, text_label = emb.id_labels()
    out = _prefixed("t2t", blocked_retrieval_metrics(text, text, text_label, text_label, ks,
                                                     self_keys=torch.arange(len(text)), **blocks))
    labels = np.asarray(emb.labels, dtype=np.int64)
    if (labels >= 0).any():
        out |= _prefixed("i2i", blocked_retrieval_metrics(image, image, labels, labels, ks,
                                                          self_keys=torch.arange(len(image)), **blocks))
    return out


def grid_items(emb: SplitEmbeddings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image rows, query caption rows, key caption rows) of the images with two captions or
    more: each image's first caption (by caption index) is its text query, its second the text
    in its keys, so no cell can be won by matching a caption with itself."""
    by_image: dict[str, list[tuple[int, int]]] = {}
    for row, (image_id, index) in enumerate(zip(emb.text_image_ids.astype(str), emb.caption_index)):
        by_image.setdefault(image_id, []).append((int(index), row))
    images, query_rows, key_rows = [], [], []
    for image_row, image_id in enumerate(emb.image_ids.astype(str)):
        captions = sorted(by_image.get(image_id, []))
        if len(captions) >= 2:
            images.append(image_row)
            query_rows.append(captions[0][1])
            key_rows.append(captions[1][1])
    return np.asarray(images, dtype=np.int64), np.asarray(query_rows, dtype=np.int64), np.asarray(key_rows, dtype=np.int64)


def modality_grid(emb: SplitEmbeddings, fusion: torch.nn.Module, ks: Sequence[int] = GRID_KS,
                  **blocks) -> dict[int, np.ndarray]:
    """R@k for queries {image, text, image+text} × keys {image, text, image+text} over the items
    of :func:`grid_items`; fused embeddings from the model's ``fusion`` module. The positive of a
    query is its own item's key."""
    images, query_rows, key_rows = grid_items(emb)
    if len(images) == 0:
        raise ValueError("the modality grid needs images with at least two captions")
    image = emb.image[images]
    with torch.no_grad():
        queries = {"image": image, "text": emb.text[query_rows], "fused": fusion(image, emb.text[query_rows])}
        keys = {"image": image, "text": emb.text[key_rows], "fused": fusion(image, emb.text[key_rows])}
    items = np.arange(len(images))
    grid = {k: np.zeros((len(MODALITIES), len(MODALITIES))) for k in ks}
    for i, q in enumerate(MODALITIES):
        for j, key in enumerate(MODALITIES):
            metrics = blocked_retrieval_metrics(queries[q], keys[key], items, items, ks, **blocks)
            for k in ks:
                grid[k][i, j] = metrics[f"R@{k}"]
    return grid


def evaluate_split(emb: SplitEmbeddings, fusion: torch.nn.Module, ks: Sequence[int] = (1, 5, 10),
                   **blocks) -> EvalReport:
    """Cross-modal, uni-modal and modality-grid retrieval of one split."""
    grid = modality_grid(emb, fusion, **blocks)
    metrics = crossmodal_metrics(emb, ks, **blocks) | unimodal_metrics(emb, ks, **blocks)
    for k, values in grid.items():
        metrics |= {f"grid_{q}2{key}_R@{k}": float(values[i, j])
                    for i, q in enumerate(MODALITIES) for j, key in enumerate(MODALITIES)}
    return EvalReport(metrics, grid)
