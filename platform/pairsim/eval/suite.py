"""The evaluation suite every run reports on a split: image↔text, uni-modal (image→image,
text→text) and the 3×3 modality grid over image, text and fused image+text items
(:func:`evaluate_split`), with the metrics of :mod:`pairsim.eval.metrics`.

The metrics' names live in :mod:`pairsim.metric_families` (no torch): its :data:`FAMILIES`, the one
list of metric families, and :func:`metric_names`, what they report. This module computes them:
:data:`COMPUTE` holds each family's compute, keyed as :data:`FAMILIES`. The names are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pairsim.metric_families import (FAMILIES, GRID_KS, MODALITIES, DataFacts, MetricFamily, Mode, directions,
                                  grid_metric_name, metric_names, ranking_metric_names, selectable_metrics,
                                  skipped_groups)
from pairsim.eval.metrics import Metrics, blocked_retrieval_metrics

__all__ = ["FAMILIES", "GRID_KS", "MODALITIES", "DataFacts", "MetricFamily", "Mode", "directions",
           "grid_metric_name", "metric_names", "ranking_metric_names", "selectable_metrics", "skipped_groups",
           "COMPUTE", "EvalReport", "SplitEmbeddings", "crossmodal_metrics", "evaluate_split", "grid_items",
           "modality_grid", "unimodal_metrics"]


@dataclass
class SplitEmbeddings:
    """A split's L2-normalised embeddings: one row per image and one per caption.

    ``labels`` are the images' class labels (−1: unknown); ``*_unimodal`` the uni-modal heads'
    embeddings, when the model has them; ``image_norm`` / ``text_norm`` [N, 1] the norms of the
    model's outputs before normalisation (None: 1), which a fusion of raw embeddings needs
    (:meth:`raw`).
    """

    image: torch.Tensor
    image_ids: np.ndarray
    labels: np.ndarray
    text: torch.Tensor
    text_image_ids: np.ndarray
    caption_index: np.ndarray
    image_unimodal: torch.Tensor | None = None
    text_unimodal: torch.Tensor | None = None
    image_norm: torch.Tensor | None = None
    text_norm: torch.Tensor | None = None

    @classmethod
    def from_batches(cls, batches: Iterable[dict[str, np.ndarray | torch.Tensor]]) -> SplitEmbeddings:
        """Concatenate :func:`embed_batch` outputs (the model's raw outputs): float columns (the
        embeddings, arrays or tensors on a device, which they stay on) become L2-normalised
        tensors, the image and text norms are kept."""
        columns: dict[str, list[np.ndarray]] = {}
        for batch in batches:
            for name, value in batch.items():
                columns.setdefault(name, []).append(value)
        fields = {name: torch.cat(parts) if isinstance(parts[0], torch.Tensor)
                  else torch.from_numpy(np.concatenate(parts)) if parts[0].dtype.kind == "f"
                  else np.concatenate(parts) for name, parts in columns.items()}
        norms = {f"{m}_norm": fields[m].norm(dim=1, keepdim=True) for m in ("image", "text")}
        return cls(**{name: F.normalize(v, dim=1) if isinstance(v, torch.Tensor) else v for name, v in fields.items()},
                   **norms)

    def to(self, device: torch.device | str) -> SplitEmbeddings:
        """These embeddings with every tensor on ``device``."""
        return dataclasses.replace(self, **{field.name: value.to(device) for field in dataclasses.fields(self)
                                            if isinstance(value := getattr(self, field.name), torch.Tensor)})

    def raw(self, modality: str, rows: np.ndarray) -> torch.Tensor:
        """The model's output for ``rows`` of ``image`` or ``text``, before normalisation."""
        norm = getattr(self, f"{modality}_norm")
        embeddings = getattr(self, modality)[rows]
        return embeddings if norm is None else embeddings * norm[rows]

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


def unimodal_metrics(emb: SplitEmbeddings, ks: Sequence[int], facts: DataFacts | None = None,
                     **blocks) -> Metrics:
    """Text→text (positives: the other captions of the same image) when some image has two
    captions, and image→image (positives: the other images of the same class) when two images
    share a class, each query's own key left out; with the uni-modal heads' embeddings when the
    model has them."""
    facts = facts or DataFacts.of(emb)
    image = emb.image if emb.image_unimodal is None else emb.image_unimodal
    text = emb.text if emb.text_unimodal is None else emb.text_unimodal
    _, text_label = emb.id_labels()
    out: Metrics = {}
    if facts.has_multi_caption:
        out |= _prefixed("t2t", blocked_retrieval_metrics(text, text, text_label, text_label, ks,
                                                          self_keys=torch.arange(len(text)), **blocks))
    labels = np.asarray(emb.labels, dtype=np.int64)
    if facts.has_labels:
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
    image, raw_image = emb.image[images], emb.raw("image", images)
    with torch.no_grad():  # the fusion sees the model's raw outputs, as in training
        queries = {"image": image, "text": emb.text[query_rows],
                   "fused": F.normalize(fusion(raw_image, emb.raw("text", query_rows)), dim=1)}
        keys = {"image": image, "text": emb.text[key_rows],
                "fused": F.normalize(fusion(raw_image, emb.raw("text", key_rows)), dim=1)}
    items = np.arange(len(images))
    grid = {k: np.zeros((len(MODALITIES), len(MODALITIES))) for k in ks}
    for i, q in enumerate(MODALITIES):
        for j, key in enumerate(MODALITIES):
            metrics = blocked_retrieval_metrics(queries[q], keys[key], items, items, ks, **blocks)
            for k in ks:
                grid[k][i, j] = metrics[f"R@{k}"]
    return grid


Compute = Callable[..., Metrics]  # (emb, fusion, ks, facts, **blocks) -> what the family's names() lists


def _grid_compute(emb: SplitEmbeddings, fusion: torch.nn.Module, ks: Sequence[int], facts: DataFacts,
                  **blocks) -> Metrics:
    grid = modality_grid(emb, fusion, **blocks)
    return {grid_metric_name(q, key, k): float(values[i, j]) for k, values in grid.items()
            for i, q in enumerate(MODALITIES) for j, key in enumerate(MODALITIES)}


COMPUTE: dict[str, Compute] = {
    "crossmodal": lambda emb, fusion, ks, facts, **blocks: crossmodal_metrics(emb, ks, **blocks),
    "unimodal": lambda emb, fusion, ks, facts, **blocks: unimodal_metrics(emb, ks, facts, **blocks),
    "grid": _grid_compute,
}
"""Each family of :data:`pairsim.metric_families.FAMILIES` computed, by the same name: called as
``(emb, fusion, ks, facts, **blocks)``, it reports exactly what the family's ``names(ks, facts)``
lists (:func:`evaluate_split` checks)."""


def evaluate_split(emb: SplitEmbeddings, fusion: torch.nn.Module, ks: Sequence[int] = (1, 5, 10),
                   **blocks) -> EvalReport:
    """Every metric family of :data:`FAMILIES` the split's :class:`DataFacts` allow: cross-modal,
    uni-modal and modality-grid retrieval, as :func:`metric_names` lists them."""
    facts = DataFacts.of(emb)
    metrics: Metrics = {}
    for name, family in FAMILIES.items():
        expected = family.names(ks, facts)
        if not expected:
            continue
        compute = COMPUTE[name] if name in COMPUTE else family.compute  # a family added from outside computes itself
        reported = compute(emb, fusion, ks, facts, **blocks)
        if set(reported) != set(expected):
            raise RuntimeError(f"metric family {name!r} reported {sorted(set(reported) ^ set(expected))} "
                               "against what its names() declare")
        metrics |= reported
    grid = {k: np.array([[metrics[grid_metric_name(q, key, k)] for key in MODALITIES] for q in MODALITIES])
            for k in GRID_KS if grid_metric_name(MODALITIES[0], MODALITIES[0], k) in metrics}
    return EvalReport(metrics, grid)
