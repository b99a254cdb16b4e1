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

import dataclasses
from collections.abc import Callable, Sequence

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

SCREEN_MAX_DEPTH = 32
"""Deepest running top-D that :func:`blocked_retrieval_metrics` screens with bfloat16 products
(D = 10 for image–caption retrieval): a screened query's survivors, about D and those within
the error bound of its D-th score, are rescored one key at a time, a cost that grows with D;
class labels (D = R, in the hundreds) take the float32 path."""

SCREEN_SPARE = 64
"""Keys beyond D that a screened query keeps in its running list (:class:`_Screen`):
a query whose list drops one that might still belong to its top D is scored exactly instead."""

SCREENED_TOGETHER = 8
"""Query blocks :func:`blocked_retrieval_metrics` screens in one pass over the keys
(:func:`_screen_keys`), each key block rounded to bfloat16 once for them all, not once per
query block."""

GATHER_BUDGET = 1 << 22
"""Most embedding entries :func:`_row_scores` gathers at a time (16 MB)."""


@dataclasses.dataclass(frozen=True)
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


def _candidate_columns(scores: torch.Tensor, depth: int, floor: torch.Tensor, maxima: torch.Tensor,
                       lowered: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """(rows, columns), row by row, of the finite scores of a block that can enter their row's
    running top-``depth``, whose ``depth``-th score so far is ``floor`` (−inf while it holds
    fewer): those reaching the cut.

    Of each row's groups (``maxima``: :func:`_group_maxima`) only those whose maximum reaches
    both the floor and the row's ``depth``-th largest group maximum can hold such a column (any
    other lies below ``depth`` others: those in the top so far, or one in each of those groups),
    so the cut is the larger of the two — the floor alone while no row has more than ``depth``
    groups reaching it. For screened scores (:class:`_Screen`) ``lowered`` takes
    a group cut down to the lowest screened score that can still reach it exactly, as ``floor``
    is already."""
    cut = floor
    chosen = maxima >= cut[:, None]
    if int(chosen.sum(1).max()) > depth:
        group_cut = maxima.topk(depth, 1).values[:, -1]
        cut = torch.maximum(group_cut if lowered is None else lowered(group_cut), floor)
        chosen = maxima >= cut[:, None]
    group_rows, group_ids, group_scores = _chosen_groups(scores, chosen)
    which, column = ((group_scores >= cut[group_rows, None]) & (group_scores > -torch.inf)).nonzero().unbind(1)
    return group_rows[which], group_ids[which] * TOP_GROUP + column


def _packed_by_row(rows: torch.Tensor, values: torch.Tensor, n_rows: int, fill: int = _NO_KEY) -> torch.Tensor:
    """``values`` of ``rows`` (in order) packed into [n_rows, m], ``fill`` where a row has fewer
    than m."""
    per_row = torch.bincount(rows, minlength=n_rows)
    slot = torch.arange(len(rows)) - (per_row.cumsum(0) - per_row)[rows]
    padded = torch.full((n_rows, int(per_row.max()) if len(rows) else 0), fill)
    padded[rows, slot] = values
    return padded


def _block_candidates(scores: torch.Tensor, start: int, depth: int, floor: torch.Tensor,
                      maxima: torch.Tensor) -> torch.Tensor:
    """:func:`_rank_keys` of every column of a score block (keys ``start`` on) that can enter its
    row's running top-``depth`` (:func:`_candidate_columns`): [rows, m], :data:`_NO_KEY` where a
    row has fewer than m. A block narrower than 4·``depth`` groups takes its exact top
    directly."""
    if 4 * depth * TOP_GROUP > scores.shape[1]:
        values, columns = _top_by_score(scores, depth)
        return _rank_keys(values, columns + start)
    rows, columns = _candidate_columns(scores, depth, floor, maxima)
    return _packed_by_row(rows, _rank_keys(scores[rows, columns], columns + start), len(scores))


def _score_block(queries: torch.Tensor, keys: torch.Tensor, start: int, width: int,
                 self_keys: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Scores against keys[start:start+width] (:func:`pairsim.compat.torch.inner_products`),
    :func:`_masked`; computed into ``out``'s memory (one cache-sized buffer reused block after
    block) where the product writes into a given buffer and the width needs no padding."""
    return _masked(compat.torch.inner_products(queries, keys[start:start + width],
                                               out.view(-1)[:len(queries) * width].view(len(queries), width)),
                   start, self_keys)


def _masked(scores: torch.Tensor, start: int, self_keys: torch.Tensor | None) -> torch.Tensor:
    """A score block of the keys ``start`` on with each query's own key at −inf, padded with
    −inf columns to a multiple of :data:`TOP_GROUP`."""
    width = scores.shape[1]
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
    maximum (``maxima``: :func:`_group_maxima`) above their threshold are read
    (:func:`_rows_read`). The rows read are used up: each score becomes 1.0 where it exceeds the
    threshold, else 0.0, in place, and a row's sum is its count (exact: at most 2²⁴ columns) —
    two passes over the block, cheaper than a bool count."""
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
    rows, read = _rows_read(scores, (maxima > threshold[:, None]).any(1))  # no other row has a score above
    return above.index_add_(0, rows, torch.gt(read, threshold[rows, None], out=read).sum(1).long())


def _rows_read(scores: torch.Tensor, reached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their scores) of the rows a count must read (``reached``): a copy while they are
    under half the rows, else every row and ``scores`` itself."""
    rows = reached.nonzero().squeeze(1)
    if 2 * len(rows) < len(scores):
        return rows, scores[rows]
    return torch.arange(len(scores)), scores


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


def _key_pass(queries: torch.Tensor, keys: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor],
              n_positive: torch.Tensor, self_keys: torch.Tensor | None, depth: int,
              key_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, above, known) of one block of queries in one pass over the keys: its running
    top-``depth`` (:func:`_rank_keys`, best first; none for ``depth`` 0) and, for the queries
    whose best positive is known, the keys ranked above it.

    The key blocks that hold the queries' positive pairs (``pairs``: :func:`_positive_pairs`)
    are scored first and kept (at most :data:`KEPT_SCORE_BLOCKS`): a query whose positives all
    lie in them (known) has its best positive (score, then lowest index) read from them. Then
    every block, kept ones first, updates the running top-``depth`` and counts the keys ranked
    above each known best positive, so a query with no positive in its top D has its exact first
    rank from the same scores."""
    n_queries, n_keys = len(queries), len(keys)
    widths = {start: min(key_block, n_keys - start) for start in range(0, n_keys, key_block)}
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
        if depth:
            candidates = _block_candidates(scores, start, min(depth, scores.shape[1]), _key_scores(top[:, -1]), maxima)
            if candidates.shape[1]:
                top = torch.cat([top, candidates], 1).topk(depth, 1).values  # sorted: best first
        if counting:  # else no query of the block has a known best positive (class labels): nothing to count
            above += _count_above(scores, start, best_score, best_index, maxima)  # uses the scores up
    return top, above, known


def _query_block_values(queries: torch.Tensor, keys: torch.Tensor, query_labels: torch.Tensor,
                        key_labels: torch.Tensor, keys_by_label: torch.Tensor, sorted_labels: torch.Tensor,
                        n_positive: torch.Tensor, self_keys: torch.Tensor | None, depth: int,
                        key_block: int) -> QueryValues:
    """:class:`QueryValues` of one block of queries in one pass over the keys (:func:`_key_pass`).
    Queries with a positive outside the kept blocks (class labels: rarely without one in their
    top D, as D ≥ R) get their first ranks from :func:`_first_positive_ranks` when they need it."""
    top, above, known = _key_pass(queries, keys, _positive_pairs(query_labels, self_keys, keys_by_label, sorted_labels),
                                  n_positive, self_keys, depth, key_block)
    hits, first_rank = _ranked_hits(top, query_labels, key_labels)
    missing = (n_positive > 0) & ~hits.any(1)
    return query_values(hits, n_positive, _counted_first_ranks(first_rank, missing, above, known, queries, keys,
                                                               query_labels, key_labels, self_keys, key_block))


def _exact_first_ranks(queries: torch.Tensor, keys: torch.Tensor, query_labels: torch.Tensor,
                       key_labels: torch.Tensor, keys_by_label: torch.Tensor, sorted_labels: torch.Tensor,
                       n_positive: torch.Tensor, self_keys: torch.Tensor | None, key_block: int) -> torch.Tensor:
    """The exact (float32) first ranks of queries with a positive, counted in one pass over the
    keys with no running top (:func:`_key_pass`, :func:`_counted_first_ranks`)."""
    _, above, known = _key_pass(queries, keys, _positive_pairs(query_labels, self_keys, keys_by_label, sorted_labels),
                                n_positive, self_keys, 0, key_block)
    return _counted_first_ranks(torch.empty_like(above), torch.ones_like(known), above, known, queries, keys,
                                query_labels, key_labels, self_keys, key_block)


def _counted_first_ranks(first_rank: torch.Tensor, needed: torch.Tensor, above: torch.Tensor, known: torch.Tensor,
                         queries: torch.Tensor, keys: torch.Tensor, query_labels: torch.Tensor,
                         key_labels: torch.Tensor, self_keys: torch.Tensor | None, key_block: int) -> torch.Tensor:
    """``first_rank`` with the queries ``needed`` marks given their exact first ranks (in place):
    one past the keys :func:`_key_pass` counted above a known best positive, else from
    :func:`_first_positive_ranks` (positives outside the kept blocks)."""
    counted = needed & known
    first_rank[counted] = above[counted] + 1
    unknown = (needed & ~known).nonzero().squeeze(1)
    if len(unknown):
        first_rank[unknown] = _first_positive_ranks(queries[unknown], keys, query_labels[unknown], key_labels,
                                                    None if self_keys is None else self_keys[unknown], key_block)
    return first_rank


def _below(values: torch.Tensor) -> torch.Tensor:
    """float32 values at or below the given (float64) ones."""
    return torch.nextafter(values.float(), torch.tensor(-torch.inf))


def _above(values: torch.Tensor) -> torch.Tensor:
    """float32 values at or above the given (float64) ones."""
    return torch.nextafter(values.float(), torch.tensor(torch.inf))


def _row_scores(queries: torch.Tensor, keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Exact (float32) scores [n, m] of each query with the keys ``index`` [n, m] lists, first
    in its row (−inf where an index lies past the keys): rows with about as many keys are
    gathered together, at most :data:`GATHER_BUDGET` entries at a time into one buffer."""
    n, m = index.shape
    valid = index < len(keys)
    index = torch.where(valid, index, 0)
    scores = torch.empty(n, m)
    listed = valid.sum(1)
    order = torch.argsort(listed, descending=True)
    buffer = torch.empty(min(GATHER_BUDGET, n * m * keys.shape[1]))
    at = 0
    while at < n and (width := int(listed[order[at]])):
        rows = order[at:at + max(1, GATHER_BUDGET // (width * keys.shape[1]))]
        gathered = torch.index_select(keys, 0, index[rows, :width].flatten(),
                                      out=buffer[:len(rows) * width * keys.shape[1]].view(-1, keys.shape[1]))
        scores[rows, :width] = torch.bmm(queries[rows, None, :], gathered.view(len(rows), width, -1).transpose(
            1, 2)).squeeze(1)
        at += len(rows)
    return scores.masked_fill_(~valid, -torch.inf)


@dataclasses.dataclass(frozen=True)
class _KeyNorms:
    """Bounds on the keys' largest norms: of a key, of its bfloat16 rounding error, and of its
    bfloat16 rounding."""

    norm: float
    rounding_error: float
    rounded: float


def _key_norms(keys: torch.Tensor, key_block: int) -> _KeyNorms:
    """:class:`_KeyNorms` (upper bounds: :func:`_norms`) of ``keys``, ``key_block`` rows at a
    time."""
    largest = torch.zeros(3, dtype=torch.float64)
    for start in range(0, len(keys), key_block):
        block = keys[start:start + key_block]
        rounded = block.bfloat16().float()
        largest = torch.maximum(largest, torch.stack([_norms(x).max() for x in (block, block - rounded, rounded)]))
    return _KeyNorms(*largest.tolist())


def _norms(rows: torch.Tensor) -> torch.Tensor:
    """Upper bounds (float64) on the Euclidean norms of float32 rows of d entries: float32's,
    raised by d·2⁻²³ of it (its sums' and square root's rounding) and by 2⁻⁶⁰·√d (squares
    under float32's range)."""
    d = rows.shape[1]
    return torch.linalg.vector_norm(rows, dim=1).double() * (1 + d * 2.0**-23) + 2.0**-60 * d**0.5


def _screen_error(queries: torch.Tensor, rounded: torch.Tensor, key_norms: _KeyNorms) -> torch.Tensor:
    """Per query, a bound (float64) over every key k on |s − a|: s the query's exact score with
    k (as :func:`_row_scores` or the float32 product computes it), a the float32 sum of the
    products of their bfloat16 roundings (``rounded``, as float32) that
    :func:`pairsim.compat.torch.bf16_inner_products` rounds.

    With q̃ = q + δq and k̃ = k + δk: |q·k − q̃·k̃| ≤ ‖δq‖‖k‖ + ‖q̃‖‖δk‖ (Cauchy–Schwarz); each
    float32 sum of d products lies within γ = 2d·2⁻²⁴ times its terms' norms' product of the
    exact one — a's, s's, and the threshold's s compared with it in another order (3‖q‖‖k‖);
    d·2⁻¹²⁰(1 + ‖q̃‖ + ‖k̃‖) covers subnormals flushed to zero; 2⁻³⁰ of the total, the float64
    arithmetic on the bounds."""
    d = queries.shape[1]
    gamma = 2 * d * 2.0**-24
    norm, rounding_error, rounded_norm = (_norms(x) for x in (queries, queries - rounded, rounded))
    tiny = d * 2.0**-120 * (1 + rounded_norm + key_norms.rounded)
    return (rounding_error * key_norms.norm + rounded_norm * key_norms.rounding_error
            + gamma * (rounded_norm * key_norms.rounded + 3 * norm * key_norms.norm) + tiny) * (1 + 2.0**-30)


def _screened_cut(screened: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest screened score (float32) a key can have whose exact score reaches
    that of every key screened at ``screened`` or above: each lies within ε + u·|a| ≤
    ε + u/(1 − u)·|o| of its screened score o (u the product's rounding), so those score at
    least L = o − u/(1 − u)·|o| − ε exactly, and a key screened at o' can reach L only if
    o' + u/(1 − u)·|o'| ≥ L − ε."""
    u = compat.torch.BF16_PRODUCT_ROUNDING
    screened = screened.double()
    reach = screened - u / (1 - u) * screened.abs() - 2 * error
    return _below(torch.where(reach >= 0, reach * (1 - u), reach * (1 - u) / (1 - 2 * u)))


def _count_bounds(scores: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, maxima: torch.Tensor,
                  spare: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(surely, possibly) per row: the keys of a screened block whose exact score is above the
    row's best positive's — a screened score above ``upper`` — and those that may be — at least
    ``lower``. Only rows with a group maximum (``maxima``) reaching ``lower`` are read
    (:func:`_rows_read`); ``spare`` (at least the block's size) takes one comparison, the
    scores read the other (used up)."""
    rows, read = _rows_read(scores, (maxima >= lower[:, None]).any(1))
    surely, possibly = (torch.zeros(len(scores), dtype=torch.long) for _ in range(2))
    if len(rows):
        at_least = torch.ge(read, lower[rows, None], out=spare.view(-1)[:read.numel()].view(read.shape))
        possibly.index_add_(0, rows, at_least.sum(1).long())
        surely.index_add_(0, rows, torch.gt(read, upper[rows, None], out=read).sum(1).long())
    return surely, possibly


class _Screen:
    """One block of queries screened with bfloat16 products, key block by key block
    (:meth:`add`), then valued (:meth:`values`): exact but for the first ranks past the top D,
    which come as ranges; queries whose values cannot be trusted are marked (overflowed).

    A screened score o lies within ε + u/(1 − u)·|o| of the exact one (ε: :func:`_screen_error`,
    the inputs' and the sums' rounding; u: the product's rounding to bfloat16, 2⁻⁸). So the D
    keys screened at or above a query's D-th best screened score o_D all score at least
    o_D − u/(1 − u)·|o_D| − ε exactly, and a key of its exact top D has a screened score at least
    :func:`_screened_cut` of o_D. Each block merges the columns that can still reach that cut
    (:func:`_candidate_columns`) into the query's running list of its D + :data:`SCREEN_SPARE`
    best screened scores; at the end the keys of the list that reach the cut are rescored
    exactly (:func:`_row_scores`) and ranked. A query that dropped from its list a key that
    reaches the final cut is overflowed.

    ``pairs`` lists every positive pair: each query's best positive is scored exactly (t), and
    every block counts the keys surely above it (screened above t + M) and those possibly above
    it (at least t − M), M = ε + u·(|t| + ε) — near 0, an untrained model's scores, mostly the
    inputs' rounding: a query with no positive in its top D has its first rank between 1 + the
    first count (and D + 1) and the second.
    """

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, n_positive: torch.Tensor,
                 pairs: tuple[torch.Tensor, torch.Tensor], self_keys: torch.Tensor | None, depth: int,
                 key_norms: _KeyNorms):
        n_queries, n_keys = len(queries), len(keys)
        self.queries, self.n_positive, self.self_keys, self.depth = queries, n_positive, self_keys, depth
        counted = n_positive > 0
        positives = _row_scores(queries, keys, _packed_by_row(*pairs, n_queries, fill=n_keys))
        best = torch.where(counted, positives.amax(1) if positives.shape[1] else 0.0, 0.0).double()
        self.rounded = queries.bfloat16()
        self.error = _screen_error(queries, self.rounded.float(), key_norms)
        margin = self.error + compat.torch.BF16_PRODUCT_ROUNDING * (best.abs() + self.error)
        self.lower = torch.where(counted, _below(best - margin), torch.inf)
        self.upper = torch.where(counted, _above(best + margin), torch.inf)
        width = depth + SCREEN_SPARE
        self.listed = _rank_keys(torch.full((n_queries, width), -torch.inf), torch.full((n_queries, width), n_keys))
        self.dropped = torch.full((n_queries,), -torch.inf)  # the best screened score dropped from the list
        self.surely, self.possibly = (torch.zeros(n_queries, dtype=torch.long) for _ in range(2))

    def _cut(self) -> torch.Tensor:
        return _screened_cut(_key_scores(self.listed[:, self.depth - 1]), self.error)

    def add(self, block: torch.Tensor, start: int, buffer: torch.Tensor, spare: torch.Tensor) -> None:
        """Screens the keys ``start`` on, ``block`` (rounded to bfloat16); ``buffer`` and
        ``spare`` are flat floats, at least the queries × the block's width (a multiple of
        :data:`TOP_GROUP`) each."""
        n_queries, width = len(self.rounded), self.listed.shape[1]
        scores = _masked(compat.torch.bf16_inner_products(self.rounded, block, buffer[:n_queries * len(block)].view(
            n_queries, len(block))), start, self.self_keys)
        maxima = _group_maxima(scores)
        candidate_rows, columns = _candidate_columns(scores, self.depth, self._cut(), maxima,
                                                     lambda group_cut: _screened_cut(group_cut, self.error))
        if len(candidate_rows):
            merged = torch.cat([self.listed, _packed_by_row(candidate_rows, _rank_keys(
                scores[candidate_rows, columns], columns + start), n_queries)], 1).topk(width + 1, 1).values
            self.listed, next_best = merged[:, :width], merged[:, width]
            self.dropped = torch.maximum(self.dropped, torch.where(next_best == _NO_KEY, -torch.inf,
                                                                   _key_scores(next_best)))
        surely, possibly = _count_bounds(scores, self.lower, self.upper, maxima, spare)
        self.surely += surely
        self.possibly += possibly

    def values(self, keys: torch.Tensor, query_labels: torch.Tensor,
               key_labels: torch.Tensor) -> tuple[QueryValues, torch.Tensor, torch.Tensor]:
        """(:class:`QueryValues`, upper bounds, overflowed) once every key block was added: the
        first ranks past the top D are lower bounds, with their upper bounds beside."""
        n_queries, n_keys, depth = len(self.queries), len(keys), self.depth
        final_cut = self._cut()
        survivor_rows, slots = (_key_scores(self.listed) >= final_cut[:, None]).nonzero().unbind(1)
        survivors = _packed_by_row(survivor_rows, _key_indices(self.listed[survivor_rows, slots]), n_queries,
                                   fill=n_keys)
        top = _rank_keys(torch.cat([_row_scores(self.queries, keys, survivors),
                                    torch.full((n_queries, depth), -torch.inf)], 1),
                         torch.cat([survivors, torch.full((n_queries, depth), n_keys)], 1)).topk(depth, 1).values
        hits, first_rank = _ranked_hits(top, query_labels, key_labels)
        counted = self.n_positive > 0
        missing = counted & ~hits.any(1)
        lowest = torch.where(missing, torch.clamp(self.surely + 1, min=depth + 1), first_rank)
        return (query_values(hits, self.n_positive, lowest), torch.where(missing, self.possibly, first_rank)[counted],
                self.dropped >= final_cut)


def _screen_keys(screens: Sequence[_Screen], keys: torch.Tensor, key_block: int) -> None:
    """Adds every block of ``key_block`` keys to each of ``screens`` (:meth:`_Screen.add`),
    rounding it to bfloat16 once for them all."""
    width = -(-min(key_block, len(keys)) // TOP_GROUP) * TOP_GROUP
    buffer, spare = (torch.empty(max(len(screen.rounded) for screen in screens) * width) for _ in range(2))
    for start in range(0, len(keys), key_block):
        block = keys[start:start + key_block].bfloat16()
        for screen in screens:
            screen.add(block, start, buffer, spare)


def _with_exact(values: QueryValues, highest: torch.Tensor, replaced: torch.Tensor,
                exact: QueryValues) -> tuple[QueryValues, torch.Tensor]:
    """``values`` and ``highest`` (first ranks' upper bounds) with the queries ``replaced``
    marks (of those with a positive) taken from ``exact``, their exact values in order."""
    first_rank, average_precision, r_precision = (getattr(values, field).clone() for field in (
        "first_rank", "average_precision", "r_precision"))
    first_rank[replaced], average_precision[replaced], r_precision[replaced] = (
        exact.first_rank, exact.average_precision, exact.r_precision)
    highest = highest.clone()
    highest[replaced] = exact.first_rank
    return QueryValues(first_rank, average_precision, r_precision, values.n_without_positive), highest


def _by_key_block(blocks: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Positions of queries in chunks of at most ``size`` whose first positives (in key blocks
    ``blocks``) lie in fewer than :data:`KEPT_SCORE_BLOCKS` blocks, so that an exact pass keeps
    the blocks that hold their positives (queries picked across the keys, as the median's are,
    would otherwise take the two-pass fallback)."""
    order = torch.argsort(blocks, stable=True)
    ordered = blocks[order]
    starts = torch.ones(len(order), dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = (starts.cumsum(0) - 1) // max(1, KEPT_SCORE_BLOCKS - 1)
    return [part for members in torch.split(order, torch.bincount(group).tolist() if len(order) else [])
            for part in torch.split(members, size) if len(part)]


def _median_resolved(lowest: torch.Tensor, highest: torch.Tensor,
                     exact: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Ranks known to lie in [lowest, highest], with those that decide their median made exact
    (``exact``: the exact ranks at the given positions), in two rounds: first the ranges that
    hold the middle of the ranges' midpoints (the likely median), then every range that meets the
    range of a middle order statistic, [k-th smallest lowest, k-th smallest highest]. Every other
    range then lies wholly below or above it, so the middle ones are the same whichever value in
    its range each of those takes (its lowest)."""
    lowest, highest = lowest.clone(), highest.clone()
    middle = sorted({(len(lowest) - 1) // 2, len(lowest) // 2}) if len(lowest) else []

    def resolve(low: torch.Tensor, high: torch.Tensor) -> None:  # the ranges meeting [low[k], high[k]]
        meeting = torch.zeros(len(lowest), dtype=torch.bool)
        for k in middle:
            meeting |= (lowest <= high[k]) & (highest >= low[k])
        positions = (meeting & (lowest < highest)).nonzero().squeeze(1)
        if len(positions):
            lowest[positions] = highest[positions] = exact(positions)

    midpoints = ((lowest + highest) / 2).sort().values
    resolve(midpoints, midpoints)
    resolve(lowest.sort().values, highest.sort().values)
    return lowest


def _ranked_hits(top: torch.Tensor, query_labels: torch.Tensor,
                 key_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, first rank) of each query's running top-D (:func:`_rank_keys`, best first; an
    index past the keys where it holds fewer): whether each rank holds a positive, and the
    1-based rank of the first (1 where none does)."""
    index = _key_indices(top)
    label = key_labels[index.clamp(max=len(key_labels) - 1)]
    hits = (index < len(key_labels)) & (label == query_labels[:, None]) & (query_labels[:, None] >= 0)
    return hits, hits.int().argmax(1) + 1


def blocked_retrieval_metrics(queries: torch.Tensor, keys: torch.Tensor, query_labels, key_labels,
                              ks: Sequence[int] = (1, 5, 10), self_keys=None, query_block: int = 1024,
                              key_block: int = 4096, screen: bool = True) -> Metrics:
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
    is summarised (:func:`query_values`) before the next starts (a group of screened blocks, below,
    after their shared pass). With
    q = min(query_block, ⌊TOP_DEPTH_BUDGET / D⌋), memory is O(q·(key_block·KEPT_SCORE_BLOCKS + D))
    for the block plus O(Q) for the per-query values (4 numbers each), whatever Q·D. It runs on
    the embeddings' device (a training worker's GPU); the per-query values come back to the host.

    ``screen``: on a CPU that multiplies bfloat16 natively
    (:func:`pairsim.compat.torch.native_bf16_products`), with D ≤ :data:`SCREEN_MAX_DEPTH` and
    every positive pair of a query block listed, the block is scored by bfloat16 products
    (about twice as fast) and screened (:class:`_Screen`): its top D and best
    positives are rescored exactly, first ranks past D come as ranges, and only the queries whose
    range can move the median rank (:func:`_median_resolved`) take the exact pass. Up to
    :data:`SCREENED_TOGETHER` query blocks are screened in one pass over the keys, their states
    (O(q·(d + D)) each) held together. The metrics are the same either way.
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
        screened = screen and depth <= SCREEN_MAX_DEPTH and compat.torch.native_bf16_products(queries.device)
        key_norms = _key_norms(keys, key_block) if screened else None

        def exact(rows: torch.Tensor | slice) -> QueryValues:
            return _query_block_values(queries[rows], keys, query_labels[rows], key_labels, keys_by_label,
                                       sorted_labels, n_positive[rows], None if self_keys is None else self_keys[rows],
                                       depth, key_block)

        def screen(block: slice) -> _Screen | None:  # None: not every positive pair of the block listed
            pairs = _positive_pairs(query_labels[block], None if self_keys is None else self_keys[block],
                                    keys_by_label, sorted_labels)
            if len(pairs[0]) < int(n_positive[block].sum()):
                return None
            return _Screen(queries[block], keys, n_positive[block], pairs,
                           None if self_keys is None else self_keys[block], depth, key_norms)

        parts, highest = [], []
        starts = range(0, len(queries), query_block)
        for group in (starts[at:at + SCREENED_TOGETHER] for at in range(0, len(starts), SCREENED_TOGETHER)):
            screens = {start: found for start in group if screened
                       and (found := screen(slice(start, start + query_block))) is not None}
            if screens:
                _screen_keys(list(screens.values()), keys, key_block)
            for start in group:
                block = slice(start, start + query_block)
                if start in screens:
                    values, high, overflowed = screens.pop(start).values(keys, query_labels[block], key_labels)
                    if overflowed.any():
                        values, high = _with_exact(values, high, overflowed[n_positive[block] > 0],
                                                   exact(overflowed.nonzero().squeeze(1) + start))
                else:
                    values = exact(block)
                    high = values.first_rank
                parts.append(values.cpu())
                highest.append(high.cpu())
        values = QueryValues(*(torch.cat([getattr(part, field) for part in parts])
                               for field in ("first_rank", "average_precision", "r_precision")),
                             sum(part.n_without_positive for part in parts))
        with_positive = (n_positive > 0).nonzero().squeeze(1)

        def exact_ranks(positions: torch.Tensor) -> torch.Tensor:
            rows = with_positive[positions.to(queries.device)]
            ranks = torch.empty(len(rows), dtype=torch.long)
            first_positive = keys_by_label[torch.searchsorted(sorted_labels, query_labels[rows])]
            for chunk in _by_key_block(first_positive // key_block, query_block):
                at = rows[chunk]
                ranks[chunk.cpu()] = _exact_first_ranks(
                    queries[at], keys, query_labels[at], key_labels, keys_by_label, sorted_labels, n_positive[at],
                    None if self_keys is None else self_keys[at], key_block).cpu()
            return ranks

        values = dataclasses.replace(values, first_rank=_median_resolved(values.first_rank, torch.cat(highest),
                                                                         exact_ranks))
    return metrics_from_query_values([values], ks)
