"""Benchmark: time and peak memory of blocked retrieval (chunked matmul + running top-k) vs dense.

    python pipelines/bench_eval.py                       # N = 1k, 3k, 10k (both), 30k, 100k (blocked only)
    python pipelines/bench_eval.py --sizes 1000 3000 --dim 512

N queries against 5N keys (text→image has 5 captions per image; here queries are images and keys
captions, the i2t direction: Q = N, K = 5N, 5 positives each), d-dimensional unit vectors where
each query is its captions' centre plus noise, so positives rank near the top as in a trained
model. Dense is :func:`pairsim.eval.metrics.retrieval_metrics` on the full Q×K matrix and its
positives (the baseline, measured in the same run while it fits in memory); blocked is
:func:`pairsim.eval.metrics.blocked_retrieval_metrics` on the embeddings and labels. Each
measurement runs in a fresh process; peak memory is the process's peak RSS minus its RSS with
the inputs built. Both must give the same metrics (checked where both run).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import torch

from pairsim.eval.metrics import blocked_retrieval_metrics, retrieval_metrics

CAPTIONS = 5


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def problem(n: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n * CAPTIONS, dim, generator=g), dim=1)
    key_labels = torch.arange(n).repeat_interleave(CAPTIONS)
    centres = keys.view(n, CAPTIONS, dim).mean(1)
    queries = torch.nn.functional.normalize(centres + 1.0 * torch.randn(n, dim, generator=g) / dim**0.5, dim=1)
    return queries, keys, torch.arange(n), key_labels


def _measure(method: str, n: int, dim: int, out) -> None:
    queries, keys, query_labels, key_labels = problem(n, dim)
    base = _rss_mb()
    start = time.perf_counter()
    if method == "dense":
        metrics = retrieval_metrics(queries @ keys.T, query_labels[:, None] == key_labels[None, :])
    else:
        metrics = blocked_retrieval_metrics(queries, keys, query_labels, key_labels)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((seconds, peak - base, metrics))


def measure(method: str, n: int, dim: int):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(method, n, dim, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10_000, 30_000, 100_000])
    parser.add_argument("--dense-max", type=int, default=10_000, help="largest N measured densely")
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    print(f"queries N × keys 5N, d = {args.dim}, {torch.get_num_threads()} threads; peak = extra RSS over the inputs")
    print(f"{'N':>8} {'keys':>8} | {'dense s':>9} {'dense MB':>9} | {'blocked s':>9} {'blocked MB':>10} | "
          f"{'time ×':>7} {'memory ×':>8} | R@1")
    for n in args.sizes:
        blocked = measure("blocked", n, args.dim)
        dense = measure("dense", n, args.dim) if n <= args.dense_max else None
        if dense is not None:
            for key, value in dense[2].items():
                assert abs(value - blocked[2][key]) < 1e-9, (n, key, value, blocked[2][key])
        cells = (f"{dense[0]:9.2f} {dense[1]:9.0f}" if dense else f"{'–':>9} {'–':>9}")
        ratios = (f"{blocked[0] / dense[0]:7.2f} {blocked[1] / max(dense[1], 1):8.3f}" if dense else f"{'–':>7} {'–':>8}")
        print(f"{n:>8,} {n * CAPTIONS:>8,} | {cells} | {blocked[0]:9.2f} {blocked[1]:10.0f} | {ratios} | "
              f"{blocked[2]['R@1']:.1f}", flush=True)


if __name__ == "__main__":
    main()
