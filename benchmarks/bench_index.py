"""Search indexes (``pairsim.serving.index``): recall@10 of the approximate kinds against exact
search, build time, size and query latency of each kind, on two sets of unit vectors.

    python benchmarks/bench_index.py [--count 1000000] [--dim 256] [--threads 2]
    python benchmarks/bench_index.py --quick          # 100,000 synthetic vectors

Synthetic: ``--count`` clustered vectors (d = ``--dim``; 256 fits 1 M in minutes on 2 cores):
1,000 Gaussian clusters in a 32-dimensional subspace plus a little isotropic noise, normalised
(embeddings have a low intrinsic dimension); queries are ``--queries`` more vectors drawn the
same way. Real: the val split of a generated shapes dataset (``pairsim.data.synth.generate``,
``--val-images`` images, 5 captions each) embedded in-process by a randomly initialised
``pairsim-tiny`` export (RetrievalModel forward, L2-normalised, d = 128): images and captions
in one index, each image's first caption the query, searching the images (``modality="image"``).

Every kind is built with :func:`~pairsim.serving.index.build_index` and searched with
``Index.search`` (ids and metadata rows included), on ``--threads`` faiss (OpenMP) threads.
Recall@10 is the share of the exact top 10 (``flat``'s, itself checked against a numpy brute
force by ``tests/test_index.py``) that a kind's top 10 holds, averaged over the queries.
Latency: batch of 1 — each of ``--single`` queries searched alone, the median and p99 of their
times; batch of 100 — ``--batches`` calls of 100 queries each, the median and p99 of a call's
time divided by 100 (what a query costs when searched in bulk). Size: the serialised index.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results

from pairsim.serving import index as ix


def clustered(n: int, dim: int, seed: int, clusters: int = 1000, latent: int = 32) -> np.ndarray:
    """``n`` unit vectors: ``clusters`` Gaussian clusters in a random ``latent``-dimensional
    subspace of R^dim, plus isotropic noise; made in blocks (float32 throughout)."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(np.random.default_rng(12345).standard_normal((dim, latent)))[0].T.astype(np.float32)
    centres = np.random.default_rng(54321).standard_normal((clusters, latent)).astype(np.float32)
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        z = centres[rng.integers(0, clusters, m)] + 0.3 * rng.standard_normal((m, latent), dtype=np.float32)
        block = z @ basis + 0.02 * rng.standard_normal((m, dim), dtype=np.float32)
        out[start:start + m] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def plain_rows(n: int, modality: str = "image") -> pa.Table:
    ids = pa.array([f"v{i}" for i in range(n)])
    nulls = pa.nulls(n, pa.string())
    return pa.table({"id": ids, "modality": pa.array([modality] * n), "image_id": ids, "caption": nulls,
                     "source": nulls})


def val_set(out: Path, images: int) -> tuple[np.ndarray, pa.Table, np.ndarray, str]:
    """(vectors, rows, queries, model digest): a generated val split embedded by a random
    pairsim-tiny export, images then captions; each image's first caption the query."""
    import torch
    import torch.nn.functional as F
    from PIL import Image

    from pairsim.config import ModelConfig
    from pairsim.data import ingest, shards, synth
    from pairsim.models import clip, retrieval

    data = out / "shapes"
    if not (data / shards.MANIFEST).exists():
        synth.generate(data, num_train=0, num_val=images, num_test=0, progress=False)
    weights = out / "tiny-random" / "model.pt"
    if not weights.exists():
        torch.manual_seed(0)
        cfg = ModelConfig(arch="pairsim-tiny")
        model = retrieval.create_retrieval_model(cfg)
        retrieval.write_exported(retrieval.model_card(cfg, model, 0, 1, 0, {}), model.state_dict(), weights)
    model, card = retrieval.load_exported(weights)
    table = shards.read_table(shards.split_shards(data, "val"), columns=["image", "image_id", "captions"]).to_pylist()
    _, eval_transform = clip.image_transforms(card.model, augment=False)
    normalize = clip.PixelNormalizer(card.model)
    captions = [(row["image_id"], k, text) for row in table for k, text in enumerate(row["captions"])]
    with torch.no_grad():
        pixels = torch.from_numpy(np.stack([eval_transform(Image.open(io.BytesIO(row["image"])).convert("RGB"))
                                            for row in table]))
        image_vectors = F.normalize(model(image=normalize(pixels))["image"], dim=-1).numpy()
        tokens = torch.from_numpy(ingest.tokenize(card.model.arch, [text for _, _, text in captions]))
        text_vectors = F.normalize(model(text=tokens)["text"], dim=-1).numpy()
    rows = pa.table({"id": [f"img:{row['image_id']}" for row in table] + [f"txt:{i}:{k}" for i, k, _ in captions],
                     "modality": ["image"] * len(table) + ["text"] * len(captions),
                     "image_id": [row["image_id"] for row in table] + [i for i, _, _ in captions],
                     "caption": [None] * len(table) + [text for _, _, text in captions],
                     "source": [str(data)] * (len(table) + len(captions))})
    first_captions = [j for j, (_, k, _) in enumerate(captions) if k == 0]
    return (np.concatenate([image_vectors, text_vectors]).astype(np.float32), rows, text_vectors[first_captions],
            retrieval.model_digest(weights))


def latencies(index: ix.Index, queries: np.ndarray, batch: int, calls: int, modality: str | None) -> tuple[float, float]:
    """(median, p99) milliseconds a query: ``calls`` searches of ``batch`` queries each (cycling
    through ``queries``), each call's time divided by ``batch``."""
    index.search(queries[:batch], 10, modality)  # warm-up
    times = []
    for call in range(calls):
        start = (call * batch) % (len(queries) - batch + 1)
        began = time.perf_counter()
        index.search(queries[start:start + batch], 10, modality)
        times.append((time.perf_counter() - began) * 1000 / batch)
    return statistics.median(times), float(np.percentile(times, 99))


def measure(table: results.Table, name: str, vectors: np.ndarray, rows: pa.Table, queries: np.ndarray,
            specs: list[dict], digest: str, args: argparse.Namespace, modality: str | None = None) -> None:
    import faiss

    exact = None
    for values in specs:
        spec = ix.parse_spec(values)
        began = time.perf_counter()
        index = ix.build_index(vectors, rows, spec, digest, "bench", name)
        build_s = time.perf_counter() - began
        found = [[hit.id for hit in line] for line in index.search(queries, 10, modality)]
        exact = exact or found  # the first spec is flat
        recall = float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(exact, found)]))
        size_mb = sum(faiss.serialize_index(part).nbytes for part in index.parts.values()) / 2**20
        single = latencies(index, queries, 1, args.single, modality)
        bulk = latencies(index, queries, min(100, len(queries)), args.batches, modality)
        parameters = ", ".join(f"{k}={v}" for k, v in spec.model_dump().items() if k not in ("kind", "seed")
                               and v is not None) or "exact"
        table.add(name, spec.kind, parameters, recall, build_s, size_mb, *single, *bulk)
        print(table.rows[-1], flush=True)
        del index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1_000_000, help="synthetic vectors")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=1000, help="synthetic queries (recall)")
    parser.add_argument("--val-images", type=int, default=2000, help="images of the real set's val split")
    parser.add_argument("--single", type=int, default=100, help="queries timed alone")
    parser.add_argument("--batches", type=int, default=5, help="batches of 100 timed")
    parser.add_argument("--threads", type=int, default=None, help="faiss's OpenMP threads (default: its own, the cores)")
    parser.add_argument("--quick", action="store_true", help="100,000 synthetic vectors, fewer timings")
    parser.add_argument("--out", type=Path, default=Path("bench_out/index"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.count, args.single, args.batches = min(args.count, 100_000), 50, 2
    import faiss

    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    table = results.Table(
        f"Recall@10 against exact search, build time, size and latency a query (ms; batch of 100: a call's time / "
        f"100), faiss on {faiss.omp_get_max_threads()} threads",
        ["vectors", "kind", "parameters", "recall@10", "build s", "size MiB", "1: median ms", "1: p99 ms",
         "100: median ms", "100: p99 ms"], ["", "", "", ".3f", ".1f", ".0f", ".3f", ".3f", ".3f", ".3f"])

    vectors, rows, queries, digest = val_set(args.out, args.val_images)
    name = f"shapes val, random pairsim-tiny ({len(vectors):,}, d={vectors.shape[1]})"
    measure(table, name, vectors, rows, queries, [
        {}, {"kind": "hnsw"}, {"kind": "ivfpq", "nlist": 32, "m": 16, "nbits": 5, "nprobe": 8},
        {"kind": "ivfpq", "nlist": 32, "m": 16, "nbits": 5, "nprobe": 8, "refine": 4}], digest, args, "image")

    data = clustered(args.count + args.queries, args.dim, seed=0)
    vectors, queries = data[:args.count], data[args.count:]
    del data
    ivfpq = {"kind": "ivfpq", "nlist": 1024, "m": args.dim // 8, "nbits": 8, "nprobe": 16, "train_size": 50_000}
    measure(table, f"synthetic clustered ({args.count:,}, d={args.dim})", vectors, plain_rows(args.count), queries,
            [{}, {"kind": "hnsw", "m": 32, "ef_construction": 40, "ef_search": 64}, ivfpq, ivfpq | {"refine": 4}],
            "0" * 64, args)
    table.notes.append("Real set: images and captions in one index, each image's first caption searching the images; "
                       "a random model's embeddings crowd together, a harder case for the approximate kinds than a "
                       "trained model's. Synthetic: 1,000 Gaussian clusters in a 32-dimensional subspace, plus noise.")
    results.publish("bench_index", [table], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
