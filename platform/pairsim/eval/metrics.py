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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

Metrics = dict[str, float]

TOP_DEPTH_BUDGET = 1 << 22
"""Most candidates (queries × D) in a query block's running top-D, a float32 score and an int64
index each (48 MB): with D large (class labels, R in the thousands)
:func:`blocked_retrieval_metrics` takes fewer queries per block."""


@dataclass(frozen=True)
class QueryValues:
    """Per-query values of the queries with at least one positive (one tensor entry each), and
    how many queries had none: everything :func:`metrics_from_query_values` averages."""

    first_rank: torch.Tensor  # long: 1-based rank of the first positive
    average_precision: torch.Tensor  # float64: AP@R
    r_precision: torch.Tensor  # float64: positives in the top R / R
    n_without_positive: int


def query_values(hits: torch.Tensor, n_positive: torch.Tensor, first_rank: torch.Tensor) -> QueryValues:
    """:class:`QueryValues` from each query's ranked relevance.

    ``hits`` bool [Q, D]: whether the key at rank i (0-based) is a positive, D ≥ every query's
    R; ``n_positive`` [Q] its R; ``first_rank`` [Q] the 1-based rank of its first positive
    (anything for queries without one). Memory O(Q·D): pass one block of queries at a time.
    """
    has_positive = n_positive > 0
    hits, r = hits[has_positive], n_positive[has_positive].double()
    if len(r) and hits.shape[1] < r.max():
        raise ValueError(f"ranked hits hold {hits.shape[1]} ranks, fewer than the largest R ({int(r.max())})")
    position = torch.arange(1, hits.shape[1] + 1, dtype=torch.float64)
    in_top_r = hits & (position[None, :] <= r[:, None])
    precision = in_top_r.double().cumsum(1) / position
    return QueryValues(first_rank=first_rank[has_positive], average_precision=(precision * in_top_r).sum(1) / r,
                       r_precision=in_top_r.sum(1) / r, n_without_positive=int((~has_positive).sum()))


def metrics_from_query_values(parts: Sequence[QueryValues], ks: Sequence[int]) -> Metrics:
    """The metrics of the module docstring from the :class:`QueryValues` of every query block."""
    first = torch.cat([part.first_rank for part in parts]).double()
    if not len(first):
        raise ValueError("no query has a positive key")
    metrics = {f"R@{k}": float((first <= k).double().mean() * 100) for k in ks}
    metrics["mAP@R"] = float(torch.cat([part.average_precision for part in parts]).mean() * 100)
    metrics["R-P"] = float(torch.cat([part.r_precision for part in parts]).mean() * 100)
    metrics["median_rank"] = float(np.median(first.numpy()))
    metrics["n_queries_without_positive"] = float(sum(part.n_without_positive for part in parts))
    return metrics


def retrieval_metrics(sim: torch.Tensor, positives: torch.Tensor, ks: Sequence[int] = (1, 5, 10)) -> Metrics:
    """``R@k`` for each k, ``mAP@R``, ``R-P``, ``median_rank`` and ``n_queries_without_positive``
    of ``sim`` [Q, K] scores with ``positives`` bool [Q, K] (see the module docstring)."""
    if sim.shape != positives.shape:
        raise ValueError(f"sim {tuple(sim.shape)} and positives {tuple(positives.shape)} differ in shape")
    order = torch.sort(sim, dim=1, descending=True, stable=True).indices
    hits = torch.gather(positives.bool(), 1, order)
    return metrics_from_query_values([query_values(hits, positives.sum(1), hits.int().argmax(1) + 1)], ks)


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


def _query_block_values(queries: torch.Tensor, keys: torch.Tensor, query_labels: torch.Tensor,
                        key_labels: torch.Tensor, n_positive: torch.Tensor, self_keys: torch.Tensor | None,
                        depth: int, key_block: int) -> QueryValues:
    """:class:`QueryValues` of one block of queries: its running top-``depth`` over the keys,
    ``key_block`` at a time, then the exact first-positive rank of queries with none in it."""
    best = torch.empty(len(queries), 0), torch.empty(len(queries), 0, dtype=torch.long)
    for k_start in range(0, len(keys), key_block):
        scores = _chunk_scores(queries, keys[k_start:k_start + key_block], k_start, self_keys)
        values, indices = _top_by_score(scores, min(depth, scores.shape[1]))
        best = _ranked(torch.cat([best[0], values], 1), torch.cat([best[1], indices + k_start], 1), depth)
    hits = (key_labels[best[1]] == query_labels[:, None]) & (query_labels[:, None] >= 0)
    first_rank = hits.int().argmax(1) + 1
    missing = ((n_positive > 0) & ~hits.any(1)).nonzero().squeeze(1)
    if len(missing):
        first_rank[missing] = _first_positive_ranks(queries[missing], keys, query_labels[missing], key_labels,
                                                    None if self_keys is None else self_keys[missing], key_block)
    return query_values(hits, n_positive, first_rank)


def blocked_retrieval_metrics(queries: torch.Tensor, keys: torch.Tensor, query_labels, key_labels,
                              ks: Sequence[int] = (1, 5, 10), self_keys=None, query_block: int = 1024,
                              key_block: int = 65536) -> Metrics:
    """:func:`retrieval_metrics` of ``queries @ keys.T`` without the full [Q, K] matrix.

    Positives are keys whose label equals the query's (labels < 0 match nothing);
    ``self_keys[q]`` is the index of query q's own key, left out of its ranking (−1: none).
    Each block of q queries is scored against ``key_block`` keys at a time (chunked matmul),
    keeping a running top-D, D = max(max(ks), largest R), and is summarised
    (:func:`query_values`) before the next block starts; queries with no positive in their top D
    get their first positive's exact rank from two further passes over the keys. With
    q = min(query_block, ⌊TOP_DEPTH_BUDGET / D⌋), memory is O(q·(key_block + D)) for the block
    plus O(Q) for the per-query values (3 numbers each), whatever Q·D.
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
    query_block = max(1, min(query_block, TOP_DEPTH_BUDGET // max(depth, 1)))
    parts = []
    for start in range(0, len(queries), query_block):
        block = slice(start, start + query_block)
        parts.append(_query_block_values(queries[block], keys, query_labels[block], key_labels, n_positive[block],
                                         None if self_keys is None else self_keys[block], depth, key_block))
    return metrics_from_query_values(parts, ks)
