"""Retrieval metrics, dense and blocked, and the evaluation suite every run reports:
image↔text, uni-modal (image→image, text→text) and the 3×3 modality grid
(:func:`evaluate_split`), its heatmap and retrieval gallery, and Ray Data batch inference
of a split's embeddings (:func:`embed_with_ray_data`).

Ranking: keys by descending score, ties broken in favour of the lower key index, so every
result is deterministic. A query's positives are given as a bool matrix
(:func:`retrieval_metrics`) or, at scale, as labels — key k is a positive of query q when
their labels are equal and non-negative (:func:`blocked_retrieval_metrics`).

Metrics (Musgrave et al., "A Metric Learning Reality Check", ECCV 2020, for mAP@R and R-P),
in percent over the queries that have at least one positive:

- ``R@k``: a positive in the top k;
- ``mAP@R`` = (1/R) Σ_{i≤R} precision@i · rel(i), R the query's number of positives;
- ``R-P`` = (positives in the top R) / R;
- ``median_rank``: median 1-based rank of the first positive;
- ``n_queries_without_positive``: queries left out of every average.
"""

from __future__ import annotations

import io
import tempfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from PIL import Image

from pairsim import data, models
from pairsim.config import ModelConfig, RunConfig

Metrics = dict[str, float]


def summarize_ranked_hits(hits: torch.Tensor, n_positive: torch.Tensor, first_rank: torch.Tensor,
                          ks: Sequence[int]) -> Metrics:
    """Metrics from each query's ranked relevance.

    ``hits`` bool [Q, D]: whether the key at rank i (0-based) is a positive, D ≥ every query's
    R; ``n_positive`` [Q] its R; ``first_rank`` [Q] the 1-based rank of its first positive
    (anything for queries without one).
    """
    has_positive = n_positive > 0
    if not has_positive.any():
        raise ValueError("no query has a positive key")
    hits, r, first = hits[has_positive], n_positive[has_positive].double(), first_rank[has_positive].double()
    if hits.shape[1] < r.max():
        raise ValueError(f"ranked hits hold {hits.shape[1]} ranks, fewer than the largest R ({int(r.max())})")
    position = torch.arange(1, hits.shape[1] + 1, dtype=torch.float64)
    in_top_r = hits & (position[None, :] <= r[:, None])
    precision = in_top_r.double().cumsum(1) / position
    metrics = {f"R@{k}": float((first <= k).double().mean() * 100) for k in ks}
    metrics["mAP@R"] = float(((precision * in_top_r).sum(1) / r).mean() * 100)
    metrics["R-P"] = float((in_top_r.sum(1) / r).mean() * 100)
    metrics["median_rank"] = float(np.median(first.numpy()))
    metrics["n_queries_without_positive"] = float((~has_positive).sum())
    return metrics


def retrieval_metrics(sim: torch.Tensor, positives: torch.Tensor, ks: Sequence[int] = (1, 5, 10)) -> Metrics:
    """``R@k`` for each k, ``mAP@R``, ``R-P``, ``median_rank`` and ``n_queries_without_positive``
    of ``sim`` [Q, K] scores with ``positives`` bool [Q, K] (see the module docstring)."""
    if sim.shape != positives.shape:
        raise ValueError(f"sim {tuple(sim.shape)} and positives {tuple(positives.shape)} differ in shape")
    order = torch.sort(sim, dim=1, descending=True, stable=True).indices
    hits = torch.gather(positives.bool(), 1, order)
    return summarize_ranked_hits(hits, positives.sum(1), hits.int().argmax(1) + 1, ks)


def _top_by_score(scores: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``depth`` best columns of each row — by score, ties to the lower column — in any order.

    ``topk`` picks an arbitrary subset of the values tied at the cut; only rows where such a tie
    straddles the cut are sorted (stably) to pick the right ones.
    """
    values, indices = scores.topk(depth, dim=1)
    straddled = (scores >= values[:, -1:]).sum(1) > depth
    if straddled.any():
        rows = straddled.nonzero().squeeze(1)
        ordered = torch.sort(scores[rows], dim=1, descending=True, stable=True)
        values[rows], indices[rows] = ordered.values[:, :depth], ordered.indices[:, :depth]
    return values, indices


def _ranked(scores: torch.Tensor, indices: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``depth`` candidates in rank order: by score, ties to the lower key index."""
    by_index = torch.argsort(indices, dim=1, stable=True)
    scores, indices = torch.gather(scores, 1, by_index), torch.gather(indices, 1, by_index)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :depth]
    return torch.gather(scores, 1, order), torch.gather(indices, 1, order)


def _chunk_scores(queries: torch.Tensor, keys: torch.Tensor, start: int, self_keys: torch.Tensor | None):
    """Scores against keys[start:start+len(keys)], with each query's own key at −inf."""
    scores = queries @ keys.T
    if self_keys is not None:
        local = self_keys - start
        rows = ((local >= 0) & (local < len(keys))).nonzero().squeeze(1)
        scores[rows, local[rows]] = -torch.inf
    return scores


def _first_positive_ranks(queries, keys, query_labels, key_labels, self_keys, key_block) -> torch.Tensor:
    """Exact 1-based rank of each query's first positive, in two passes over the keys: find the
    best positive (score, then lowest index), then count the keys ranked above it."""
    best_score = torch.full((len(queries),), -torch.inf)
    best_index = torch.full((len(queries),), len(keys), dtype=torch.long)
    for start in range(0, len(keys), key_block):
        scores = _chunk_scores(queries, keys[start:start + key_block], start, self_keys)
        positive = (key_labels[None, start:start + key_block] == query_labels[:, None]) & ~torch.isinf(scores)
        value, index = torch.where(positive, scores, -torch.inf).max(1)
        better = positive.any(1) & (value > best_score)
        best_score, best_index = torch.where(better, value, best_score), torch.where(better, index + start, best_index)
    above = torch.zeros(len(queries), dtype=torch.long)
    for start in range(0, len(keys), key_block):
        scores = _chunk_scores(queries, keys[start:start + key_block], start, self_keys)
        index = torch.arange(start, start + scores.shape[1])
        above += ((scores > best_score[:, None]) |
                  ((scores == best_score[:, None]) & (index[None, :] < best_index[:, None]))).sum(1)
    return above + 1


def blocked_retrieval_metrics(queries: torch.Tensor, keys: torch.Tensor, query_labels, key_labels,
                              ks: Sequence[int] = (1, 5, 10), self_keys=None, query_block: int = 1024,
                              key_block: int = 65536) -> Metrics:
    """:func:`retrieval_metrics` of ``queries @ keys.T`` without the full [Q, K] matrix.

    Positives are keys whose label equals the query's (labels < 0 match nothing);
    ``self_keys[q]`` is the index of query q's own key, left out of its ranking (−1: none).
    Each block of ``query_block`` queries is scored against ``key_block`` keys at a time
    (chunked matmul), keeping a running top-D, D = max(max(ks), largest R): memory is
    O(query_block·key_block + Q·D). Queries with no positive in their top D get their first
    positive's exact rank from two further passes over the keys (per query block).
    """
    queries, keys = queries.float(), keys.float()
    query_labels, key_labels = torch.as_tensor(query_labels, dtype=torch.long), torch.as_tensor(key_labels,
                                                                                                 dtype=torch.long)
    self_keys = None if self_keys is None else torch.as_tensor(self_keys, dtype=torch.long)
    labels, counts = torch.unique(key_labels[key_labels >= 0], return_counts=True)
    n_positive = torch.zeros(len(queries), dtype=torch.long)
    known = (query_labels >= 0) & torch.isin(query_labels, labels)
    n_positive[known] = counts[torch.searchsorted(labels, query_labels[known])]
    if self_keys is not None:
        has_self = self_keys >= 0
        own_label = torch.where(has_self, key_labels[self_keys.clamp(min=0)], -1)
        n_positive -= (has_self & (own_label == query_labels) & (query_labels >= 0)).long()
    rankable = len(keys) - (0 if self_keys is None else 1)
    depth = min(max(max(ks), int(n_positive.max()) if len(n_positive) else 0), rankable)

    hits, first_rank = [], []
    for q_start in range(0, len(queries), query_block):
        block = queries[q_start:q_start + query_block]
        block_self = None if self_keys is None else self_keys[q_start:q_start + query_block]
        best = torch.empty(len(block), 0), torch.empty(len(block), 0, dtype=torch.long)
        for k_start in range(0, len(keys), key_block):
            scores = _chunk_scores(block, keys[k_start:k_start + key_block], k_start, block_self)
            values, indices = _top_by_score(scores, min(depth, scores.shape[1]))
            best = _ranked(torch.cat([best[0], values], 1), torch.cat([best[1], indices + k_start], 1), depth)
        block_labels = query_labels[q_start:q_start + query_block]
        block_hits = (key_labels[best[1]] == block_labels[:, None]) & (block_labels[:, None] >= 0)
        block_first = block_hits.int().argmax(1) + 1
        missing = ((n_positive[q_start:q_start + query_block] > 0) & ~block_hits.any(1)).nonzero().squeeze(1)
        if len(missing):
            block_first[missing] = _first_positive_ranks(block[missing], keys, block_labels[missing], key_labels,
                                                         None if block_self is None else block_self[missing],
                                                         key_block)
        hits.append(block_hits)
        first_rank.append(block_first)
    return summarize_ranked_hits(torch.cat(hits), n_positive, torch.cat(first_rank), ks)


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


def grid_heatmap(grid: dict[int, np.ndarray], path: str | Path, title: str = "") -> Path:
    """The modality grid as one annotated 3×3 heatmap per k (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grid), figsize=(4.2 * len(grid), 4), squeeze=False)
    for ax, (k, values) in zip(axes[0], sorted(grid.items())):
        ax.imshow(values, vmin=0, vmax=100, cmap="viridis")
        ax.set_xticks(range(3), [f"{m} key" for m in MODALITIES])
        ax.set_yticks(range(3), [f"{m} query" for m in MODALITIES])
        ax.set_title(f"R@{k} (%)")
        for (i, j), value in np.ndenumerate(values):
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="white" if value < 60 else "black")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def retrieval_gallery(emb: SplitEmbeddings, read_rows: Callable[[list[str]], dict[str, dict[str, Any]]],
                      path: str | Path, n_queries: int = 4, k: int = 5) -> Path:
    """A PNG of ``n_queries`` text queries (spread over the split), each with its top-``k``
    images, hits framed green and misses red. ``read_rows(ids)`` gives each image's shard row
    (``image`` bytes and ``captions``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    query_rows = np.linspace(0, len(emb.text) - 1, num=min(n_queries, len(emb.text))).round().astype(int)
    top = torch.sort(emb.text[query_rows].float() @ emb.image.float().T, dim=1, descending=True, stable=True)
    top = top.indices[:, :k].numpy()
    ids = [str(i) for i in emb.image_ids]
    rows = read_rows(sorted({ids[j] for j in top.ravel()} | {str(emb.text_image_ids[q]) for q in query_rows}))
    fig, axes = plt.subplots(len(query_rows), k, figsize=(2.2 * k, 2.6 * len(query_rows)), squeeze=False)
    for line, (q, found) in enumerate(zip(query_rows, top)):
        target = str(emb.text_image_ids[q])
        caption = rows[target]["captions"][int(emb.caption_index[q])]
        axes[line][0].set_title(caption if len(caption) < 60 else caption[:57] + "…", loc="left", fontsize=9)
        for rank, (ax, j) in enumerate(zip(axes[line], found), start=1):
            with Image.open(io.BytesIO(rows[ids[j]]["image"])) as image:
                ax.imshow(image.convert("RGB"))
            hit = ids[j] == target
            ax.set_xticks([]), ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_edgecolor("green" if hit else "red")
                spine.set_linewidth(4)
            ax.set_xlabel(f"{rank}. {ids[j]}" + (" ✓" if hit else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


class EmbedBatches:
    """Ray Data actor: a model embedding decoded images (``pixels``) or tokenized captions
    (``tokens``), returning the ids that go with them and every embedding the model gives."""

    def __init__(self, model: torch.nn.Module, model_cfg: dict[str, Any], use_gpu: bool):
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = model.to(self.device).eval()
        self.normalize = models.PixelNormalizer(ModelConfig.model_validate(model_cfg))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return embed_batch(self.model, batch, self.normalize, self.device)


def embed_batch(model, batch: dict[str, np.ndarray], normalize: models.PixelNormalizer, device,
                dtype: torch.dtype = torch.float32) -> dict[str, np.ndarray]:
    """One batch of ``data.eval_images`` (``pixels``) or ``data.eval_texts`` (``tokens``) through
    ``model`` (a RetrievalModel or the engine wrapping one): the ids that go with the rows and
    every embedding the model gives, named as :class:`SplitEmbeddings` fields."""
    if "pixels" in batch:
        fields = {"image_ids": batch["image_id"], "labels": batch["label"]}
        out = model(image=normalize(torch.from_numpy(batch["pixels"]).to(device), dtype))
    else:
        fields = {"text_image_ids": batch["image_id"], "caption_index": batch["caption_index"]}
        out = model(text=torch.from_numpy(batch["tokens"]).to(device))
    return fields | {k: v.float().cpu().numpy() for k, v in out.items()}


def embed_with_ray_data(model: models.RetrievalModel, cfg: RunConfig, split: str) -> SplitEmbeddings:
    """A split's embeddings by Ray Data batch inference: the shards decoded and tokenized by
    CPU tasks, embedded by ``eval.concurrency`` actors (one GPU each with ``train.use_gpu``)
    anywhere on the cluster, collected on the driver."""
    ledger_name = f"pairsim-eval-skips-{uuid.uuid4().hex[:8]}"
    ledger = data.skip_ledger(ledger_name)
    embed = dict(fn_constructor_args=(model, cfg.model.model_dump(mode="json"), cfg.train.use_gpu),
                 batch_size=cfg.eval.batch_size, concurrency=cfg.eval.concurrency,
                 num_gpus=1 if cfg.train.use_gpu else 0)
    try:
        batches = [batch for ds in (data.eval_images(cfg, split, ledger_name), data.eval_texts(cfg, split))
                   for batch in ds.map_batches(EmbedBatches, **embed).iter_batches(batch_size=None,
                                                                                   batch_format="numpy")]
        skipped = ray.get(ledger.get.remote())
    finally:
        ray.kill(ledger)
    if skipped:
        print(f"[pairsim] {split}: skipped {len(skipped)} unreadable images, e.g. {next(iter(skipped.items()))}")
    return SplitEmbeddings.from_batches(batches)


def log_report(logger, report: EvalReport, emb: SplitEmbeddings, read_rows, split: str, step: int,
               title: str = "") -> None:
    """Into an MLflow run: ``<split>/<metric>`` metrics, ``eval/<split>.json`` and the modality
    grid heatmap and retrieval gallery PNGs under ``eval/``."""
    logger.log_metrics({f"{split}/{k}": v for k, v in report.metrics.items()}, step)
    logger.log_dict({"split": split, "metrics": report.metrics,
                     "grid": {f"R@{k}": v.tolist() for k, v in report.grid.items()}, "grid_axes": MODALITIES},
                    f"eval/{split}.json")
    with tempfile.TemporaryDirectory() as tmp:
        logger.log_artifact(grid_heatmap(report.grid, Path(tmp) / f"{split}_modality_grid.png", title), "eval")
        logger.log_artifact(retrieval_gallery(emb, read_rows, Path(tmp) / f"{split}_gallery.png"), "eval")


def format_report(metrics: Metrics, ks: Sequence[int] = (1, 5, 10)) -> str:
    """The report as a table: one row per direction, then RSUM and the modality grid's R@1."""
    columns = [f"R@{k}" for k in ks] + ["mAP@R", "R-P", "median_rank"]
    lines = [f"{'direction':<14}" + "".join(f"{c:>12}" for c in columns)]
    for direction, label in (("i2t", "image→text"), ("t2i", "text→image"), ("i2i", "image→image"),
                             ("t2t", "text→text")):
        if f"{direction}_R@{ks[0]}" in metrics:
            lines.append(f"{label:<14}" + "".join(f"{metrics[f'{direction}_{c}']:12.2f}" for c in columns))
    lines.append(f"{'RSUM':<14}{metrics['rsum']:12.2f}")
    if f"grid_image2image_R@{GRID_KS[0]}" in metrics:
        lines += ["", f"modality grid R@{GRID_KS[0]} (rows: queries)", f"{'':<14}" + "".join(f"{m:>12}" for m in MODALITIES)]
        for q in MODALITIES:
            lines.append(f"{q:<14}" + "".join(f"{metrics[f'grid_{q}2{key}_R@{GRID_KS[0]}']:12.2f}" for key in MODALITIES))
    return "\n".join(lines)
