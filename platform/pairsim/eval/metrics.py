"""Retrieval metrics of queries against keys, dense (:func:`retrieval_metrics`, from a whole
score matrix) and blocked (:func:`blocked_retrieval_metrics`, without one), both through the
per-query values of :func:`query_values`. Pure functions on tensors: the evaluation suite that
runs them on a split is :mod:`pairsim.eval.suite`, its embeddings come from
:mod:`pairsim.eval.inference`, its tables and pictures from :mod:`pairsim.eval.report`.

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

from pairsim import compat

Metrics = dict[str, float]

TOP_DEPTH_BUDGET = 1 << 22
"""Most candidates (queries × D) in a query block's running top-D, a float32 score and an int64
index each (48 MB): with D large (class labels, R in the thousands)
:func:`blocked_retrieval_metrics` takes fewer queries per block."""

TOP_GROUP = 64
"""Columns per group when a score block's top-D, count and ties are narrowed to the groups that
can hold them; score blocks are padded with −inf to a multiple of it (key blocks rounded up)."""

POSITIVE_PAIR_BUDGET = 1 << 20
"""Most (query, key) positive pairs a query block reads its best positives from (16 MB of
indices); with more (class labels) the first ranks of queries with none in their top D take two
further passes."""

KEPT_SCORE_BLOCKS = 4
"""Most score blocks (query block × key block, 16 MB at the defaults) a query block keeps while
it finds its best positives: the key blocks that hold them, scored first."""


@dataclass(frozen=True)
class QueryValues:
    """Per-query values of the queries with at least one positive (one tensor entry each), and
    how many queries had none: everything :func:`metrics_from_query_values` averages."""

    first_rank: torch.Tensor  # long: 1-based rank of the first positive
    average_precision: torch.Tensor  # float64: AP@R
    r_precision: torch.Tensor  # float64: positives in the top R / R
    n_without_positive: int

    def cpu(self) -> QueryValues:
        return QueryValues(self.first_rank.cpu(), self.average_precision.cpu(), self.r_precision.cpu(),
                           self.n_without_positive)


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


_LOW_BITS = 0xFFFFFFFF
_NO_KEY = torch.iinfo(torch.int64).min  # below every :func:`_rank_keys` key: a row's padding


def _rank_keys(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """int64 keys that order (score, key index) pairs as the ranking does: a larger key ranks
    higher — a higher score, or the same score and a lower index. The high 32 bits are the
    score's bits as a signed magnitude (so −0.0 and +0.0 tie, as they compare), the low 32 bits
    2³² − 1 − the index, so one integer ``topk`` ranks a row exactly."""
    bits = scores.view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits) << 32 | (_LOW_BITS - indices)


def _key_scores(keys: torch.Tensor) -> torch.Tensor:
    """The scores :func:`_rank_keys` packed (−0.0 read back as +0.0)."""
    high = (keys >> 32).int()
    return torch.where(high < 0, -high | -0x80000000, high).view(torch.float32)


def _key_indices(keys: torch.Tensor) -> torch.Tensor:
    """The key indices :func:`_rank_keys` packed."""
    return _LOW_BITS - (keys & _LOW_BITS)


def _group_maxima(scores: torch.Tensor) -> torch.Tensor:
    """Each row's maximum over each group of :data:`TOP_GROUP` consecutive columns (a score
    block's width is a multiple of it: :func:`_score_block`)."""
    return scores.view(len(scores), -1, TOP_GROUP).amax(2)


def _chosen_groups(scores: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, group ids, scores [n, :data:`TOP_GROUP`]) of the n groups that ``chosen`` (bool
    [rows, groups]) marks, row by row."""
    rows, ids = chosen.nonzero().unbind(1)
    return rows, ids, scores.view(len(scores), -1, TOP_GROUP)[rows, ids]


def _block_candidates(scores: torch.Tensor, start: int, depth: int, floor: torch.Tensor,
                      maxima: torch.Tensor) -> torch.Tensor:
    """:func:`_rank_keys` of every column of a score block (keys ``start`` on) that can enter its
    row's running top-``depth``, whose ``depth``-th score so far is ``floor`` (−inf while it holds
    fewer): [rows, m], :data:`_NO_KEY` where a row has fewer than m.

    Of each row's groups (``maxima``: :func:`_group_maxima`) only those whose maximum reaches
    both the floor and the row's ``depth``-th largest group maximum can hold such a column (any
    other lies below ``depth`` others: those in the top so far, or one in each of those groups),
    so the exact top is taken over those groups alone — a few per row once the floor has risen.
    Where no row has more than ``depth`` groups reaching the floor, those are the groups; of
    their columns only those reaching the cut are listed, packed row by row."""
    n_rows, width = scores.shape
    if 4 * depth * TOP_GROUP > width:
        values, columns = _top_by_score(scores, depth)
        return _rank_keys(values, columns + start)
    cut = floor
    chosen = maxima >= cut[:, None]
    if int(chosen.sum(1).max()) > depth:
        cut = torch.maximum(maxima.topk(depth, 1).values[:, -1], floor)
        chosen = maxima >= cut[:, None]
    group_rows, group_ids, group_scores = _chosen_groups(scores, chosen)
    which, column = (group_scores >= cut[group_rows, None]).nonzero().unbind(1)
    rows = group_rows[which]
    keys = _rank_keys(group_scores[which, column], group_ids[which] * TOP_GROUP + column + start)
    per_row = torch.bincount(rows, minlength=n_rows)
    slot = torch.arange(len(rows)) - (per_row.cumsum(0) - per_row)[rows]  # rows come in order: nonzero's
    padded = torch.full((n_rows, int(per_row.max()) if len(rows) else 0), _NO_KEY)
    padded[rows, slot] = keys
    return padded


def _score_block(queries: torch.Tensor, keys: torch.Tensor, start: int, width: int,
                 self_keys: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Scores against keys[start:start+width] (:func:`pairsim.compat.torch.inner_products`), with
    each query's own key at −inf, padded with −inf columns to a multiple of :data:`TOP_GROUP`;
    computed into ``out``'s memory (one cache-sized buffer reused block after block) where the
    product writes into a given buffer and the width needs no padding."""
    scores = compat.torch.inner_products(queries, keys[start:start + width],
                                         out.view(-1)[:len(queries) * width].view(len(queries), width))
    if width % TOP_GROUP:
        scores = torch.nn.functional.pad(scores, (0, -width % TOP_GROUP), value=-torch.inf)
    if self_keys is not None:
        local = self_keys - start
        rows = ((local >= 0) & (local < width)).nonzero().squeeze(1)
        scores[rows, local[rows]] = -torch.inf
    return scores


def _first_positive_ranks(queries, keys, query_labels, key_labels, self_keys, key_block) -> torch.Tensor:
    """Exact 1-based rank of each query's first positive, in two passes over the keys: find the
    best positive (score, then lowest index), then count the keys ranked above it."""
    buffer = torch.empty(len(queries), min(key_block, len(keys)))
    best_score = torch.full((len(queries),), -torch.inf)
    best_index = torch.full((len(queries),), len(keys), dtype=torch.long)
    for start in range(0, len(keys), key_block):
        block_labels = key_labels[start:start + key_block]
        scores = _score_block(queries, keys, start, len(block_labels), self_keys, buffer)[:, :len(block_labels)]
        positive = (block_labels[None, :] == query_labels[:, None]) & (scores > -torch.inf)
        value, index = torch.where(positive, scores, -torch.inf).max(1)
        better = positive.any(1) & (value > best_score)
        best_score, best_index = torch.where(better, value, best_score), torch.where(better, index + start, best_index)
    above = torch.zeros(len(queries), dtype=torch.long)
    for start in range(0, len(keys), key_block):
        scores = _score_block(queries, keys, start, min(key_block, len(keys) - start), self_keys, buffer)
        above += _count_above(scores, start, best_score, best_index, _group_maxima(scores))
    return above + 1


def _count_above(scores: torch.Tensor, start: int, best_score: torch.Tensor, best_index: torch.Tensor,
                 maxima: torch.Tensor) -> torch.Tensor:
    """Per row, the keys of this block (keys ``start`` on) ranked above the row's best positive
    (``best_score`` at ``best_index``): a higher score, or the same score at a lower index.

    One comparison per score: against the next float down in blocks wholly before the positive
    (score ≥ it), against its score after it; the positive's own block adds the ties before it,
    listed from the groups up to the positive's that reach its score. Only rows with a group
    maximum (``maxima``: :func:`_group_maxima`) above their threshold are read, all of them
    where that is half the rows or more (an untrained model's). The rows read are used up: each
    score becomes 1.0 where it exceeds the threshold, else 0.0, in place, and a row's sum is its
    count (exact: at most 2²⁴ columns) — two passes over the block, cheaper than a bool count."""
    n_rows, width = scores.shape
    position = best_index - start  # the best positive's column, where it lies in this block
    inside = (position >= 0) & (position < width)
    above = torch.zeros(n_rows, dtype=torch.long)
    if inside.any():
        up_to_positive = torch.arange(maxima.shape[1]) <= (position // TOP_GROUP)[:, None]
        rows, ids, group_scores = _chosen_groups(
            scores, (maxima >= best_score[:, None]) & up_to_positive & inside[:, None])
        which, column = (group_scores == best_score[rows, None]).nonzero().unbind(1)
        tie_rows = rows[which]
        above += torch.bincount(tie_rows[ids[which] * TOP_GROUP + column < position[tie_rows]], minlength=n_rows)
    threshold = torch.where(best_index >= start + width, torch.nextafter(best_score, torch.tensor(-torch.inf)),
                            best_score)
    rows = (maxima > threshold[:, None]).any(1).nonzero().squeeze(1)  # no other row has a score above
    if 2 * len(rows) < n_rows:
        read = scores[rows]
        above[rows] += torch.gt(read, threshold[rows, None], out=read).sum(1).long()
        return above
    return above + torch.gt(scores, threshold[:, None], out=scores).sum(1).long()


def _positive_pairs(query_labels: torch.Tensor, self_keys: torch.Tensor | None, keys_by_label: torch.Tensor,
                    sorted_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows, key indices) of every positive pair of a query block, its own key left out —
    none when there are more than :data:`POSITIVE_PAIR_BUDGET` (class labels, R in the
    thousands). Keys come from ``keys_by_label`` (key indices sorted by label; ``sorted_labels``
    their labels)."""
    first = torch.searchsorted(sorted_labels, query_labels)
    count = torch.where(query_labels >= 0, torch.searchsorted(sorted_labels, query_labels, right=True) - first, 0)
    total = int(count.sum())
    if total > POSITIVE_PAIR_BUDGET:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(query_labels)), count)
    offset = torch.arange(total) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    keys = keys_by_label[first[rows] + offset]
    if self_keys is None:
        return rows, keys
    own = keys == self_keys[rows]
    return rows[~own], keys[~own]


def _query_block_values(queries: torch.Tensor, keys: torch.Tensor, query_labels: torch.Tensor,
                        key_labels: torch.Tensor, keys_by_label: torch.Tensor, sorted_labels: torch.Tensor,
                        n_positive: torch.Tensor, self_keys: torch.Tensor | None, depth: int,
                        key_block: int) -> QueryValues:
    """:class:`QueryValues` of one block of queries in one pass over the keys.

    The key blocks that hold the queries' positive pairs are scored first and kept (at most
    :data:`KEPT_SCORE_BLOCKS`): each query's best positive (score, then lowest index) is read
    from them. Then every block, kept ones first, updates the running top-``depth`` and counts
    the keys ranked above the best positive, so a query with no positive in its top D has its
    exact first rank from the same scores. Queries with a positive outside the kept blocks
    (class labels: rarely without one in their top D, as D ≥ R) get theirs from
    :func:`_first_positive_ranks` when they need it."""
    n_queries, n_keys = len(queries), len(keys)
    widths = {start: min(key_block, n_keys - start) for start in range(0, n_keys, key_block)}
    pairs = _positive_pairs(query_labels, self_keys, keys_by_label, sorted_labels)
    holding = (torch.unique(pairs[1] // key_block) * key_block).tolist()
    kept = {start: _score_block(queries, keys, start, widths[start], self_keys, torch.empty(n_queries, widths[start]))
            for start in holding[:KEPT_SCORE_BLOCKS]}
    rows, indices = pairs
    block_start = indices // key_block * key_block
    in_kept = torch.isin(block_start, torch.tensor(list(kept), dtype=torch.long))
    rows, indices, block_start = rows[in_kept], indices[in_kept], block_start[in_kept]
    values = torch.empty(len(rows))
    for start, scores in kept.items():
        in_block = block_start == start
        values[in_block] = scores[rows[in_block], indices[in_block] - start]
    best_score = torch.full((n_queries,), -torch.inf).scatter_reduce(0, rows, values, "amax")
    best_index = torch.full((n_queries,), n_keys).scatter_reduce(  # ties: the lowest index
        0, rows, torch.where(values == best_score[rows], indices, n_keys), "amin")
    known = (torch.bincount(rows, minlength=n_queries) == n_positive) & (n_positive > 0)
    best_score, best_index = torch.where(known, best_score, torch.inf), torch.where(known, best_index, n_keys)
    counting = bool(known.any())
    top = _rank_keys(torch.full((n_queries, depth), -torch.inf), torch.full((n_queries, depth), n_keys))
    above = torch.zeros(n_queries, dtype=torch.long)
    buffer = torch.empty(n_queries, min(key_block, n_keys))
    for start in [*kept, *(start for start in widths if start not in kept)]:
        scores = kept.pop(start) if start in kept else _score_block(queries, keys, start, widths[start], self_keys,
                                                                      buffer)
        maxima = _group_maxima(scores)
        candidates = _block_candidates(scores, start, min(depth, scores.shape[1]), _key_scores(top[:, -1]), maxima)
        if candidates.shape[1]:
            top = torch.cat([top, candidates], 1).topk(depth, 1).values  # sorted: best first
        if counting:  # else no query of the block has a known best positive (class labels): nothing to count
            above += _count_above(scores, start, best_score, best_index, maxima)  # uses the scores up
    top_index = _key_indices(top)
    hits = (key_labels[top_index] == query_labels[:, None]) & (query_labels[:, None] >= 0)
    first_rank = hits.int().argmax(1) + 1
    missing = (n_positive > 0) & ~hits.any(1)
    first_rank = torch.where(missing & known, above + 1, first_rank)
    unknown = (missing & ~known).nonzero().squeeze(1)
    if len(unknown):
        first_rank[unknown] = _first_positive_ranks(queries[unknown], keys, query_labels[unknown], key_labels,
                                                    None if self_keys is None else self_keys[unknown], key_block)
    return query_values(hits, n_positive, first_rank)


def blocked_retrieval_metrics(queries: torch.Tensor, keys: torch.Tensor, query_labels, key_labels,
                              ks: Sequence[int] = (1, 5, 10), self_keys=None, query_block: int = 1024,
                              key_block: int = 4096) -> Metrics:
    """:func:`retrieval_metrics` of ``queries @ keys.T`` without the full [Q, K] matrix, in one
    pass over the keys.

    Positives are keys whose label equals the query's (labels < 0 match nothing);
    ``self_keys[q]`` is the index of query q's own key, left out of its ranking (−1: none).
    Each block of q queries is scored against ``key_block`` keys at a time (rounded up to a
    multiple of :data:`TOP_GROUP`), a cache-sized block of q × key_block floats (as faiss's
    exact search does). The key blocks that
    hold the block's positives are scored first, which gives every query its best positive;
    every block then updates a running top-D, D = max(max(ks), largest R), and counts the keys
    ranked above the best positive, so a query with no positive in its top D (an untrained
    model's) has its exact first rank from the same scores, not from more passes. A query block
    is summarised (:func:`query_values`) before the next starts. With
    q = min(query_block, ⌊TOP_DEPTH_BUDGET / D⌋), memory is O(q·(key_block·KEPT_SCORE_BLOCKS + D))
    for the block plus O(Q) for the per-query values (3 numbers each), whatever Q·D. It runs on
    the embeddings' device (a training worker's GPU); the per-query values come back to the host.
    """
    with torch.device(queries.device):  # every tensor made here on the embeddings' device
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
        keys_by_label = torch.argsort(key_labels, stable=True)
        sorted_labels = key_labels[keys_by_label]
        rankable = len(keys) - (0 if self_keys is None else 1)
        depth = max(1, min(max(max(ks), int(n_positive.max()) if len(n_positive) else 0), rankable))
        query_block = max(1, min(query_block, TOP_DEPTH_BUDGET // max(depth, 1)))
        key_block = -(-key_block // TOP_GROUP) * TOP_GROUP  # so only the last block needs padding
        parts = []
        for start in range(0, len(queries), query_block):
            block = slice(start, start + query_block)
            parts.append(_query_block_values(queries[block], keys, query_labels[block], key_labels, keys_by_label,
                                             sorted_labels, n_positive[block],
                                             None if self_keys is None else self_keys[block], depth, key_block).cpu())
    return metrics_from_query_values(parts, ks)
