"""One pass over a CPU score block of :func:`pairsim.eval.metrics.blocked_retrieval_metrics`:
each row's running top-D and its count of keys ranked above the row's best positive, read from
the block once (compiled with numba), where the vectorised torch path reads it about ten times.

The top-D of a row is a binary min-heap of (score, key index) ordered by rank — a higher score
ranks first, a tie goes to the lower index — so its root is the rank to beat; a chunk of
:data:`CHUNK` scores is looked at one by one only when one of them reaches the root's score, as
in faiss's exhaustive search. Rows are split among torch's intra-op thread count, each share
scanned by the compiled function with the GIL released.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numba
import numpy as np
import torch

CHUNK = 64
"""Scores compared with the heap's root in one vectorised loop before any is pushed."""


@numba.njit(inline="always")
def _ranks_below(score, index, other_score, other_index):
    return score < other_score or (score == other_score and index > other_index)


@numba.njit(inline="always")
def _replace_root(heap_score, heap_index, score, index):
    depth, at = len(heap_score), 0
    while 2 * at + 1 < depth:
        child = 2 * at + 1
        if child + 1 < depth and _ranks_below(heap_score[child + 1], heap_index[child + 1], heap_score[child],
                                              heap_index[child]):
            child += 1
        if not _ranks_below(heap_score[child], heap_index[child], score, index):
            break
        heap_score[at], heap_index[at] = heap_score[child], heap_index[child]
        at = child
    heap_score[at], heap_index[at] = score, index


@numba.njit(nogil=True, cache=True)
def _scan_rows(scores, start, best_score, best_index, above, heap_score, heap_index, count):
    width = scores.shape[1]
    for row in range(scores.shape[0]):
        values, best, best_column = scores[row], best_score[row], best_index[row] - start
        if count:  # ranked above the best positive: a higher score, or the same at a lower index
            n_above = 0
            if best_column >= width:
                for column in range(width):
                    n_above += values[column] >= best
            else:
                for column in range(width):
                    n_above += values[column] > best
                for column in range(min(max(best_column, 0), width)):
                    n_above += values[column] == best
            above[row] += n_above
        heap_s, heap_i = heap_score[row], heap_index[row]
        for first in range(0, width, CHUNK):
            last, floor, reaching = min(first + CHUNK, width), heap_s[0], 0
            for column in range(first, last):
                reaching += values[column] >= floor
            if reaching:
                for column in range(first, last):
                    score = values[column]
                    if _ranks_below(heap_s[0], heap_i[0], score, start + column):
                        _replace_root(heap_s, heap_i, score, start + column)


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="pairsim-block-scan")


def scan_block(scores: torch.Tensor, start: int, best_score: torch.Tensor, best_index: torch.Tensor,
               above: torch.Tensor, heap_score: torch.Tensor, heap_index: torch.Tensor, count: bool) -> None:
    """Update the heaps (``heap_score``, ``heap_index``: [rows, D], float32 and int64, padded with
    (−inf, the number of keys)) with ``scores`` — the block of keys ``start`` on, −inf for a
    key left out, which ranks above the padding only —
    and, when ``count``, add to ``above`` each row's keys ranked above its best positive
    (``best_score`` at ``best_index``; +inf where unknown). Every tensor is a contiguous CPU
    tensor, updated in place."""
    arrays = [t.numpy() for t in (scores, best_score, best_index, above, heap_score, heap_index)]
    threads = max(1, min(torch.get_num_threads(), len(scores)))
    bounds = np.linspace(0, len(scores), threads + 1).astype(int)
    shares = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    scan = lambda rows: _scan_rows(arrays[0][rows], start, *(a[rows] for a in arrays[1:]), count)  # noqa: E731
    if threads == 1:
        scan(shares[0])
    else:
        list(_pool(threads).map(scan, shares))
