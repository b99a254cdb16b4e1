"""Batch embedding throughput: ``pairsim embed``'s Ray Data pipeline against a plain torch
``DataLoader`` loop running the same decode + preprocessing code (``pairsim.data.ingest.EvalImages``)
and the same model call (``pairsim.eval.inference.EmbedBatches``) with the same number of CPU
workers over the same images, in one run.

    python benchmarks/bench_embed.py [--images 4096] [--cpus 2] [--repeats 3] [--arch pairsim-tiny] [--use-gpu]

The images are a synthetic shapes val split (``pairsim.data.synth.generate``, 64 px PNG); the
model is a randomly initialised ``--arch`` (``pairsim-tiny``: 64 px; ``ViT-B-32``: 224 px).
Both sides get ``--cpus`` CPUs: Ray Data a local instance of that many, whose decoding tasks
also embed on a CPU (one fused task a shard, each process holding a copy of the model;
``pairsim.eval.inference.embedded_by``) or one model actor on a GPU beside its decode tasks; the
DataLoader ``--cpus`` decode workers and the model in the main process (torch's default threads),
all at the same niceness (Ray's workers at nice 0, not its default 15). Each side is warmed up
once (worker processes started, imports done, shards in the page cache), then timed
``--repeats`` times, the two taking turns; the medians are reported. Ray Data's runs are
``pairsim.serving.embeddings.pipeline`` as ``pairsim embed`` runs it (the model put in Ray's
object store anew each run, as each job does), the embeddings collected on the driver; the
DataLoader keeps its workers between runs. Both count from asking for the first batch to the
last; the seconds to the first batch say how much of that is start-up.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results

from pairsim.config import RunConfig
from pairsim.data import ingest, shards, skips, synth
from pairsim.eval.inference import EmbedBatches
from pairsim.models import retrieval
from pairsim.serving import embeddings


class ShardImages(torch.utils.data.IterableDataset):
    """The DataLoader baseline's input: each worker reads its share of the shards, in batches,
    and runs the very ``EvalImages`` the Ray Data pipeline runs."""

    def __init__(self, cfg: RunConfig, files: list[str]):
        self.files, self.size = files, cfg.eval.batch_size
        self.preprocess = ingest.EvalImages(cfg, skips.Skips("no-ledger", "none"))  # the synthetic images all decode

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for file in self.files[worker::workers]:
            table = pq.read_table(file, columns=["image", "image_id", "label"])
            for start in range(0, table.num_rows, self.size):
                rows = table.slice(start, self.size).to_pydict()
                yield self.preprocess({k: np.asarray(v, dtype=object if k != "label" else None) for k, v in rows.items()})


def dataloader_run(loader, embed: EmbedBatches) -> tuple[float, float]:
    """(images/s, seconds to the first embedded batch) of one pass of the DataLoader loop."""
    start, first, vectors = time.perf_counter(), None, []
    for batch in loader:
        vectors.append(embeddings.normalized(embed(batch)["image"]))
        first = first or time.perf_counter() - start
    return sum(map(len, vectors)) / (time.perf_counter() - start), first


def pipeline_run(model, cfg: RunConfig) -> tuple[float, float]:
    """(images/s, seconds to the first embedded batch) of ``embed_split``'s pipeline over the
    split's images, collected on the driver as the job collects them (without writing them)."""
    manifest = shards.read_manifest(cfg.data.path)
    pending = {"image": shards.split_shards(cfg.data.path, "val", manifest)}
    bench_skips = skips.new_scope("bench-embed")
    start, first, vectors = time.perf_counter(), None, []
    for block in embeddings.pipeline(model, cfg, "val", manifest, pending, bench_skips).iter_batches(
            batch_size=None, batch_format="numpy"):
        vectors.append(embeddings.normalized(block["image"]))
        first = first or time.perf_counter() - start
    seconds = time.perf_counter() - start
    bench_skips.drop()
    return sum(map(len, vectors)) / seconds, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--rows-per-shard", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of each side: decode workers, model actors")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arch", default="pairsim-tiny", help="open_clip architecture, randomly initialised")
    parser.add_argument("--use-gpu", action="store_true", help="the model on a GPU on both sides")
    parser.add_argument("--out", type=Path, default=Path("bench_out/embed"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    data = out / f"shapes-{args.images}"
    if not (data / shards.MANIFEST).exists():
        synth.generate(data, num_train=0, num_val=args.images, num_test=0, rows_per_shard=args.rows_per_shard)
    concurrency = 1 if args.use_gpu else args.cpus
    cfg = RunConfig.model_validate({"data": {"path": str(data)}, "model": {"arch": args.arch},
                                    "train": {"use_gpu": args.use_gpu},
                                    "eval": {"batch_size": args.batch_size, "concurrency": concurrency}})
    torch.manual_seed(0)
    model = retrieval.create_retrieval_model(cfg.model)
    weights = out / "model" / "model.pt"
    retrieval.claim_export(weights)
    retrieval.write_exported(retrieval.model_card(cfg.model, model, 0, 1, 0, {}), model.state_dict(), weights)
    model, _ = retrieval.load_exported(weights)

    import ray

    # Ray's workers run at nice 15 by default: on a machine shared with other work they would get only what the
    # DataLoader's (nice 0) leave over; both sides at the same niceness
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.cpus, num_gpus=1 if args.use_gpu else 0)
    ray.data.DataContext.get_current().enable_progress_bars = False
    loader = torch.utils.data.DataLoader(ShardImages(cfg, shards.split_files(data, "val")), batch_size=None,
                                         num_workers=args.cpus, prefetch_factor=4, persistent_workers=True,
                                         multiprocessing_context="fork")
    embed = EmbedBatches(copy.deepcopy(model), cfg.model, args.use_gpu)  # the pipeline's processes get their own
    pipeline_run(model, cfg)  # warm-ups: processes, imports, page cache
    dataloader_run(loader, embed)
    runs: dict[str, list[tuple[float, float]]] = {"loader": [], "ray": []}
    for _ in range(args.repeats):
        runs["loader"].append(dataloader_run(loader, embed))
        runs["ray"].append(pipeline_run(model, cfg))
    ray.shutdown()
    (loader_rate, loader_first), (ray_rate, ray_first) = (
        (statistics.median(r for r, _ in runs[k]), statistics.median(f for _, f in runs[k])) for k in ("loader", "ray"))
    device = "GPU" if args.use_gpu else "CPU"
    table = results.Table(
        f"Embedding {args.images:,} images ({args.arch}, random init, {device}; batch {args.batch_size}, "
        f"{args.cpus} CPUs each side; Ray Data embeds "
        f"{'in 1 model actor' if args.use_gpu else 'in its decoding tasks'}), median of {args.repeats} runs after a "
        "warm-up one",
        ["pipeline", "img/s", "vs DataLoader", "s to 1st batch"], ["", ".0f", ".2f", ".1f"])
    table.add("torch DataLoader loop (workers kept)", loader_rate, 1.0, loader_first)
    table.add("pairsim embed's Ray Data pipeline", ray_rate, ray_rate / loader_rate, ray_first)
    table.notes.append("Per run, img/s: DataLoader " + ", ".join(f"{r:.0f}" for r, _ in runs["loader"])
                       + "; Ray Data " + ", ".join(f"{r:.0f}" for r, _ in runs["ray"]) + ".")
    results.publish("bench_embed", [table], args.results, time.perf_counter() - started, on_gpu=args.use_gpu)


if __name__ == "__main__":
    main()
