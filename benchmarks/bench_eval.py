"""Benchmark: time and peak memory of blocked retrieval (one pass of cache-sized score blocks: running
top-D and exact first ranks) against the dense computation and faiss's exact search.

    python benchmarks/bench_eval.py                       # N = 1k, 3k, 10k (both), 30k, 100k (blocked only)
    python benchmarks/bench_eval.py --sizes 1000 3000 --dim 512
    python benchmarks/bench_eval.py --regimes trained untrained --faiss --sizes 10000 --dim 512 --dense-max 0
                                                      # untrained: an early checkpoint, first ranks counted past the top D
    git show 95fdf8c:platform/pairsim/eval/metrics.py > /tmp/metrics_95fdf8c.py
    python benchmarks/bench_eval.py --classes 3 --sizes 2000 4000 6000 --dim 64 --dense-max 2000 \
        --compare-with /tmp/metrics_95fdf8c.py --mmap-threshold 131072

N queries against 5N keys (text→image has 5 captions per image; here queries are images and keys
captions, the i2t direction: Q = N, K = 5N, 5 positives each), d-dimensional unit vectors where
each query is its captions' centre plus noise, so positives rank near the top as in a trained
model. With ``--classes C`` an image's label is its class (image index mod C) instead of its
own: R = 5N/C positives per query, so the running top-D is D = R deep. Dense is
:func:`pairsim.eval.metrics.retrieval_metrics` on the full Q×K matrix and its positives (the
baseline, measured in the same run while it fits in memory); blocked is
:func:`pairsim.eval.metrics.blocked_retrieval_metrics` on the embeddings and labels;
``--compare-with FILE`` also measures the ``blocked_retrieval_metrics`` of another metrics
module (e.g. an older commit's: the "other" columns); ``--faiss`` also faiss's exact
``IndexFlatIP`` top-10 on the same embeddings (index built and searched, R@k from its top-k;
``÷faiss`` is blocked's time over faiss's; with it, blocked's float32 matrix products alone, in
the same blocks, the floor of its unscreened time). Blocked screens with bfloat16 products where
the CPU has them (``screen``); unscreened is the same call with ``screen=False``, measured up to
``--unscreened-max``. Each measurement runs in a fresh process;
peak memory is the process's peak RSS (VmHWM) minus its RSS with the inputs built, freed memory
that glibc keeps in its heaps included unless ``--mmap-threshold`` fixes glibc's mmap threshold
(large blocks then go back to the system when freed, so the peak counts live tensors). All must
give the same metrics (checked).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim.eval import metrics as metrics_module
from pairsim.eval.metrics import blocked_retrieval_metrics, retrieval_metrics

CAPTIONS = 5


def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MB: unlike ``ru_maxrss``, VmHWM
    does not inherit the RSS of the process that forked this one."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def problem(n: int, dim: int, classes: int | None = None, seed: int = 0, untrained: bool = False):
    """(queries, keys, query labels, key labels): labels are the image index, or its class.
    ``untrained``: queries unrelated to their captions (random unit vectors), as an early
    checkpoint's are: almost no positive in any top-D, every first rank counted past it."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n * CAPTIONS, dim, generator=g), dim=1)
    image_labels = torch.arange(n) if classes is None else torch.arange(n) % classes
    centres = keys.view(n, CAPTIONS, dim).mean(1)
    noise = torch.randn(n, dim, generator=g)
    queries = torch.nn.functional.normalize(noise if untrained else centres + noise / dim**0.5, dim=1)
    return queries, keys, image_labels, image_labels.repeat_interleave(CAPTIONS)


def _blocked_from(path: str):
    """``blocked_retrieval_metrics`` of the metrics module at ``path``."""
    spec = importlib.util.spec_from_file_location("other_metrics", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.blocked_retrieval_metrics


def _measure(method: str, n: int, dim: int, classes: int | None, other: str | None, untrained: bool, out) -> None:
    queries, keys, query_labels, key_labels = problem(n, dim, classes, untrained=untrained)
    blocked = _blocked_from(other) if method == "other" else blocked_retrieval_metrics
    base = _status_mb("VmRSS")
    start = time.perf_counter()
    if method == "dense":
        metrics = retrieval_metrics(queries @ keys.T, query_labels[:, None] == key_labels[None, :])
    elif method == "faiss":
        metrics = faiss_recall(queries, keys, query_labels, key_labels)
    elif method == "matmul":
        metrics = blocked_matmul(queries, keys)
    elif method == "unscreened":
        metrics = blocked(queries, keys, query_labels, key_labels, screen=False)
    else:
        metrics = blocked(queries, keys, query_labels, key_labels)
    seconds = time.perf_counter() - start
    out.put((seconds, _status_mb("VmHWM") - base, metrics))


def faiss_recall(queries, keys, query_labels, key_labels, ks=(1, 5, 10)) -> dict[str, float]:
    """R@k from faiss's exact inner-product top-k (``IndexFlatIP``, what a user would pick instead
    of pairsim's blocked search): the index built and searched, both timed."""
    import faiss

    index = faiss.IndexFlatIP(keys.shape[1])
    index.add(keys.numpy())
    _, top = index.search(queries.numpy(), max(ks))
    hits = key_labels.numpy()[top] == query_labels.numpy()[:, None]
    return {f"R@{k}": 100.0 * float(hits[:, :k].any(1).mean()) for k in ks}


def blocked_matmul(queries, keys) -> dict[str, float]:
    """Blocked's score blocks alone: its own ``_score_block`` (the same matrix products, into the
    same buffers) at ``blocked_retrieval_metrics``'s default block sizes, with no ranking or
    counting — the part of its time no change to its bookkeeping removes. No metrics."""
    defaults = inspect.signature(blocked_retrieval_metrics).parameters
    query_block, key_block = defaults["query_block"].default, defaults["key_block"].default
    buffer = torch.empty(query_block, min(key_block, len(keys)))
    for start in range(0, len(queries), query_block):
        for key_start in range(0, len(keys), key_block):
            metrics_module._score_block(queries[start:start + query_block], keys, key_start,
                                        min(key_block, len(keys) - key_start), None, buffer)
    return {}


def measure(method: str, n: int, dim: int, classes: int | None, other: str | None, untrained: bool = False):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(method, n, dim, classes, other, untrained, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def _median_run(runs: list) -> tuple[float, float, dict]:
    """(median seconds, median MB, metrics) of one method's runs, whose metrics must agree."""
    assert all(run[2] == runs[0][2] for run in runs), "a method's runs gave different metrics"
    return statistics.median(run[0] for run in runs), statistics.median(run[1] for run in runs), runs[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10_000, 30_000, 100_000])
    parser.add_argument("--dense-max", type=int, default=10_000, help="largest N measured densely")
    parser.add_argument("--unscreened-max", type=int, default=30_000,
                        help="largest N also measured unscreened (screen=False: float32 products throughout)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--classes", type=int, help="C class labels: R = 5N/C positives per query")
    parser.add_argument("--compare-with", metavar="FILE",
                        help="a metrics.py whose blocked_retrieval_metrics is measured too")
    parser.add_argument("--faiss", action="store_true",
                        help="also faiss IndexFlatIP's exact top-10 (R@k only; checked equal to blocked's)")
    parser.add_argument("--regimes", nargs="+", choices=("trained", "untrained"), default=["trained"],
                        help="trained: queries near their captions; untrained: unrelated (an early checkpoint), "
                             "R@1 near chance; one table each")
    parser.add_argument("--mmap-threshold", type=int, help="MALLOC_MMAP_THRESHOLD_ (bytes) of the measuring processes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each method this many times in turn at each size up to --repeat-max and report "
                             "the median time and memory (single runs move by about ±10 %% on a shared machine)")
    parser.add_argument("--repeat-max", type=int, default=30_000,
                        help="largest N measured --repeats times; larger ones (minutes a run) once")
    results.add_results_argument(parser)
    args = parser.parse_args()
    if args.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by each spawned process's glibc
    started = time.perf_counter()
    tables = [regime_table(args, untrained=regime == "untrained") for regime in args.regimes]
    results.publish("bench_eval", tables, args.results, time.perf_counter() - started)


def regime_table(args: argparse.Namespace, untrained: bool) -> results.Table:
    positives = "5 positives each" if args.classes is None else f"{args.classes} classes, R = 5N/{args.classes}"
    table = results.Table(
        f"{'Untrained' if untrained else 'Trained'} queries: N queries × 5N keys ({positives}), d = {args.dim}, "
        f"{torch.get_num_threads()} threads; each side in a fresh process, peak = VmHWM over the inputs' RSS "
        f"(mmap threshold {args.mmap_threshold or 'dynamic'})",
        ["N", "keys", "dense s", "dense MB", "blocked s", "blocked MB", "× dense time", "× dense memory"],
        [",", ",", ".2f", ".0f", ".2f", ".0f", ".2f", ".3f"])
    if args.compare_with:
        table.columns += ["other s", "other MB"]
        table.formats += [".2f", ".0f"]
    table.columns += ["unscreened s", "× unscreened time"]
    table.formats += [".2f", ".2f"]
    if args.faiss:
        table.columns += ["faiss s", "faiss MB", "÷ faiss time", "÷ faiss memory", "blocked's matmul s",
                          "matmul ÷ faiss time"]
        table.formats += [".2f", ".0f", ".2f", ".1f", ".2f", ".2f"]
    table.columns.append("R@1")
    table.formats.append(".1f")
    for n in args.sizes:
        methods = ["blocked", *(["dense"] if n <= args.dense_max else []), *(["other"] if args.compare_with else []),
                   *(["unscreened"] if n <= args.unscreened_max else []), *(["faiss", "matmul"] if args.faiss else [])]
        runs = {method: [] for method in methods}
        for _ in range(args.repeats if n <= args.repeat_max else 1):
            for method in methods:  # in turn, so a slow spell of the machine touches every method alike
                runs[method].append(measure(method, n, args.dim, args.classes, args.compare_with, untrained))
        blocked, dense, other, unscreened, faiss, matmul = (
            _median_run(runs[m]) if m in runs else None for m in ("blocked", "dense", "other", "unscreened", "faiss",
                                                                  "matmul"))
        for name, result in (("dense", dense), ("other", other), ("unscreened", unscreened), ("faiss", faiss)):
            for key, value in (result[2] if result else {}).items():
                assert abs(value - blocked[2][key]) < 1e-9, (name, n, key, value, blocked[2][key])
        row = [n, n * CAPTIONS, *(dense[:2] if dense else (None, None)), blocked[0], blocked[1],
               *((blocked[0] / dense[0], blocked[1] / max(dense[1], 1)) if dense else (None, None))]
        if args.compare_with:
            row += list(other[:2])
        row += [unscreened[0], blocked[0] / unscreened[0]] if unscreened else [None, None]
        if args.faiss:
            row += [faiss[0], faiss[1], blocked[0] / faiss[0], blocked[1] / max(faiss[1], 1), matmul[0],
                    matmul[0] / faiss[0]]
        table.add(*row, blocked[2]["R@1"])
        print(f"N = {n:,}: blocked {blocked[0]:.2f} s", flush=True)
    table.notes.append("Every method gave blocked's metrics at every size (checked).")
    if args.repeats > 1:
        table.notes.append(f"Times and memory: medians of {args.repeats} runs of each method, in turn, at N ≤ "
                           f"{args.repeat_max:,}; one run above.")
    return table


if __name__ == "__main__":
    main()
