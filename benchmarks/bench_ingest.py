"""Ingest throughput: pairsim's Ray Data pipeline against a torch ``DataLoader`` running the same
decode / augment / tokenize code (``pairsim.data.ingest.TrainPreprocess``) with the same number of CPU
workers over the same shards, in one run; then the share of step time a real training run
(the demo's tiny model, 2 workers, no test split: only its training epochs and their
validation are what it measures) spends waiting for data.

    python benchmarks/bench_ingest.py [--cpus 2] [--repeats 3] [--skip-training]

Two datasets: the demo's 64 px shapes (PNG, tiny model's 64 px transform) and 400×300 JPEG
"photos" built with ``pairsim shards build`` and cut to 224 px by ViT-B-32's transform.
Both pipelines are timed the same way: built once, one untimed warm-up epoch (worker processes
started, imports done, shards in the page cache), then ``--repeats`` timed epochs over the same
object — Ray Data's dataset with its decode workers kept alive between epochs, the DataLoader
with ``persistent_workers`` — each epoch's images/s measured from asking for its first batch to
its last (that epoch's start-up included); the median is reported. Ray Data is timed twice,
with each shard's SHA-256 checked as it is read (``data.shard_checks: error``, what runs use)
and without (``off``), and without the local shuffle buffer, the seeded order and a shard's rows
held as one block (:data:`VARIANTS`), all taking turns epoch by epoch: what the check costs, and
what each epoch's first batch waits for. Where the machine's CPU goes in the timed epochs is
sampled for every process (:mod:`machine_cpu`): the consumer (this process), the decode workers,
Ray's other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import torch
from PIL import Image

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from machine_cpu import MachineCpu, ray_data_task

from pairsim.data import builder, ingest, shards, skips, synth
from pairsim.config import RunConfig
from pairsim.data.build_config import BuildConfig
from pairsim.models import clip


def make_photos(out: Path, images: int) -> Path:
    """``images`` 400×300 JPEGs of smooth colour fields plus noise (JPEG-sized like photos), as shards."""
    if (out / shards.MANIFEST).exists():
        return out
    src = out.parent / f"{out.name}-src"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:300, 0:400] / 400.0
    with open(src / "captions.jsonl", "w") as f:
        for i in range(images):
            a, b, c = rng.random(3)
            field = np.stack([np.sin(6 * a * xx + b), np.cos(5 * b * yy + c), np.sin(4 * c * (xx + yy))], -1)
            pixels = np.clip(127 + 100 * field + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(src / f"{i:05d}.jpg", quality=90)
            f.write(json.dumps({"file": f"{i:05d}.jpg",
                                "captions": [f"photo {i} number {k} of a colourful field" for k in range(5)]}) + "\n")
    builder.build(BuildConfig(format="folder", input=src / "captions.jsonl", out=out, rows_per_shard=256,
                             max_side=512))
    return out


@dataclass(frozen=True)
class Epoch:
    images: int
    rate: float  # images/s from asking for the first batch to the last
    first_batch_s: float  # seconds to the first batch
    rate_after_first: float  # images/s from the first batch to the last


def median_epoch(epochs: list[Epoch]) -> Epoch:
    """Each field's median over the epochs."""
    return Epoch(*(statistics.median(getattr(e, f.name) for e in epochs) for f in fields(Epoch)))


class ShardBatches(torch.utils.data.IterableDataset):
    """The DataLoader baseline: each worker reads its share of the shards' row groups, in
    micro-batches, and runs the very ``TrainPreprocess`` the Ray Data pipeline runs."""

    def __init__(self, cfg: RunConfig, files: list[str]):
        self.cfg, self.files = cfg, files
        self.preprocess = ingest.TrainPreprocess(cfg, skips.Skips("no-ledger", "none"))  # the synthetic images all decode

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        rng = np.random.default_rng(worker)
        size = self.cfg.train.micro_batch_size
        for k, (file, group) in enumerate(groups):
            if k % workers != worker:
                continue
            table = pq.ParquetFile(file).read_row_group(group, columns=["image", "image_id", "captions"])
            for start in range(0, table.num_rows - size + 1, size):
                rows = table.slice(start, size).to_pydict()
                batch = {k: np.asarray(v, dtype=object) for k, v in rows.items()}
                batch["draw"] = rng.random(size)
                yield self.preprocess(batch)


def dataloader(cfg: RunConfig, cpus: int) -> torch.utils.data.DataLoader:
    files = shards.split_files(cfg.data.path, cfg.data.train_split)
    return torch.utils.data.DataLoader(ShardBatches(cfg, files), batch_size=None, num_workers=cpus, prefetch_factor=4,
                                       persistent_workers=True, multiprocessing_context="fork")


def timed_epoch(batches) -> Epoch:
    """One epoch of ``batches`` (an iterable, its iterator made and its first batch asked for
    inside the timing)."""
    start, images, first = time.perf_counter(), 0, None
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        images += len(batch["pixels"])
    seconds = time.perf_counter() - start
    return Epoch(images, images / seconds, first, (images - len(batch["pixels"])) / (seconds - first))


# Ray Data variants timed in turn: (data config overrides, rows in their seeded order, a block per
# micro-batch). "checked" is what runs do; the others leave out the SHA-256 check, the local shuffle
# buffer the first batch waits to fill, the order that keeps a seeded run's batches the same, or a
# shard's decoded rows held back as one block (Ray Data's default target_max_block_size, 128 MiB).
VARIANTS = {"checked": ({}, True, False), "checks off": ({"shard_checks": "off"}, True, False),
            "no shuffle buffer": ({"shuffle_buffer": 0}, True, False), "any order": ({}, False, False),
            "no shuffle buffer, any order": ({"shuffle_buffer": 0}, False, False),
            "no shuffle buffer, any order, a block per batch": ({"shuffle_buffer": 0}, False, True)}


DATALOADER = "DataLoader (no shuffle within the epoch)"
CPU_GROUPS = ("consumer", "decode", "others", "rest")  # see cpu_per_image


def ray_data_batches(cfg: RunConfig, dataset):
    return dataset.iter_torch_batches(batch_size=cfg.train.micro_batch_size, drop_last=True,
                                      prefetch_batches=cfg.data.prefetch_batches,
                                      local_shuffle_buffer_size=cfg.data.shuffle_buffer or None)


def throughput(name: str, cfg: RunConfig, cpus: int, repeats: int) -> tuple[str, Epoch, dict[str, Epoch],
                                                                           dict[str, dict[str, float]]]:
    """(name, the DataLoader's epoch, Ray Data's for each of :data:`VARIANTS`, where the CPU went
    in the DataLoader's and in each variant's timed epochs: :func:`cpu_per_image`), each epoch
    the medians of ``repeats`` epochs after a warm-up one; the Ray Data variants take turns,
    epoch by epoch."""
    bench_skips = skips.new_scope("bench-ingest")
    spans: dict[str, list[tuple[float, float]]] = {}

    def timed(pipeline: str, batches) -> Epoch:
        began = time.time()
        epoch = timed_epoch(batches)
        spans.setdefault(pipeline, []).append((began, time.time()))
        return epoch

    with MachineCpu() as cpu:
        pipelines = {}
        for variant, (overrides, ordered, block_per_batch) in VARIANTS.items():
            changed = cfg.model_copy(update={"data": cfg.data.model_copy(update=overrides)})
            dataset = ingest.train_dataset(changed, bench_skips)
            dataset.context.execution_options = ingest.execution_options(changed, ordered=ordered)
            if block_per_batch:  # a block is let out once over this size, sliced once over 1.5×: a batch's pixels
                size = clip.preprocess_cfg(cfg.model).size
                height, width = (size, size) if isinstance(size, int) else size
                dataset.context.target_max_block_size = cfg.train.micro_batch_size * 3 * height * width
            timed_epoch(ray_data_batches(changed, dataset))  # warm-up: worker processes, imports, page cache
            pipelines[variant] = changed, dataset
        epochs: dict[str, list[Epoch]] = {variant: [] for variant in VARIANTS}
        for _ in range(repeats):
            for variant, (changed, dataset) in pipelines.items():
                epochs[variant].append(timed(variant, ray_data_batches(changed, dataset)))
        loader = dataloader(cfg, cpus)
        timed_epoch(loader)  # the same warm-up
        loader_epochs = [timed(DATALOADER, loader) for _ in range(repeats)]
        del loader  # its persistent workers end
    bench_skips.drop()
    images = {DATALOADER: loader_epochs} | epochs
    used = {pipeline: cpu_per_image(cpu, spans[pipeline], sum(e.images for e in images[pipeline])) for pipeline in spans}
    return name, median_epoch(loader_epochs), {variant: median_epoch(e) for variant, e in epochs.items()}, used


def cpu_per_image(cpu: MachineCpu, spans: list[tuple[float, float]], images: int) -> dict[str, float]:
    """ms of CPU per image over ``spans`` by group: this process (the pipeline's consumer: Ray
    Data's iterator threads, the DataLoader's main process), the decode workers (Ray Data's tasks,
    the DataLoader's forked workers), Ray's other processes, the rest of the machine; and the
    machine's busy %."""
    me, own_title = os.getpid(), " ".join(psutil.Process().cmdline())
    forked = lambda process: process.parent == me and process.titles[0] == own_title  # noqa: E731  (DataLoader workers)
    seconds = cpu.by_group(spans, cpu.classify(consumer=lambda process: process.pid == me,
                                               decode=lambda process: ray_data_task(process) or forked(process)))
    wall = sum(end - start for start, end in spans)
    return {g: seconds.get(g, 0.0) * 1e3 / images for g in CPU_GROUPS} | {
        "busy": 100 * seconds["busy"] / (wall * psutil.cpu_count())}


def data_wait(dataset: Path, out: Path, epochs: int, log_every: int | None) -> tuple[dict[str, list[float]], float]:
    """(the perf/* data-wait metrics per epoch, median samples/s) of a real run of the demo config."""
    from mlflow.tracking import MlflowClient

    from pairsim.train import driver
    from pairsim.cli import DEMO_CONFIG
    from pairsim.config import load_config

    out.mkdir(parents=True, exist_ok=True)  # its MLflow store's folder must exist
    cfg = load_config(DEMO_CONFIG, [f"data.path={dataset}", "data.test_split=null", f"train.epochs={epochs}",
                                    f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", f"ray.storage_path={out}/ray"]
                      + ([f"train.log_every_n_steps={log_every}"] if log_every else []))
    result = driver.fit(cfg)
    client = MlflowClient(result.tracking_uri)
    waits = {key: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, key), key=lambda m: m.step)]
             for key in ("perf/data_wait_share", "perf/data_wait_share_running", "perf/first_batch_wait_s")}
    rates = [m.value for m in client.get_metric_history(result.mlflow_run_id, "train/samples_per_s")]
    if not rates:
        raise SystemExit(f"the training run logged no train/samples_per_s: it ran fewer than "
                         f"train.log_every_n_steps={cfg.train.log_every_n_steps} steps; pass --log-every")
    return waits, statistics.median(rates)


def throughput_tables(args: argparse.Namespace, shapes: Path, out: Path) -> list[results.Table]:
    import ray

    ray.init(num_cpus=args.cpus)
    ray.data.DataContext.get_current().enable_progress_bars = False
    photos = make_photos(out / "photos", args.images)
    rows = []
    for name, path, arch in (("shapes 64 px PNG → 64 (pairsim-tiny)", shapes, "pairsim-tiny"),
                             ("photos 400×300 JPEG → 224 (ViT-B-32)", photos, "ViT-B-32")):
        cfg = RunConfig.model_validate({"data": {"path": str(path), "val_split": "train"}, "model": {"arch": arch},
                                        "train": {"micro_batch_size": args.batch_size}})
        rows.append(throughput(name, cfg, args.cpus, args.repeats))
    ray.shutdown()
    table = results.Table(f"Ingest throughput: {args.images} images, batch {args.batch_size}, {args.cpus} CPU workers "
                          f"each, median of {args.repeats} epochs after a warm-up one; Ray Data checks each shard's "
                          f"SHA-256 as it reads it (data.shard_checks: error, the default), the last two columns "
                          f"are without (off)",
                          ["data", "DataLoader img/s", "Ray Data img/s", "ratio", "Ray Data, checks off img/s",
                           "checked / off"], ["", ".0f", ".0f", ".2f", ".0f", ".2f"])
    start = results.Table(f"Where the ratio goes: each epoch's seconds to its first batch, and the images/s from "
                          f"there to its last (medians of the same {args.repeats} epochs; Ray Data with checks)",
                          ["data", "DataLoader 1st batch s", "Ray Data 1st batch s", "DataLoader img/s after it",
                           "Ray Data img/s after it", "ratio after it"], ["", ".2f", ".2f", ".0f", ".0f", ".2f"])
    waits = results.Table(f"What Ray Data's first batch waits for: each variant leaves one thing out of the run's "
                          f"pipeline (medians of the same {args.repeats} epochs, taken in turn)",
                          ["data", "pipeline", "1st batch s", "img/s", "÷ DataLoader"], ["", "", ".2f", ".0f", ".2f"])
    cpu = results.Table(f"Where the CPU went in the timed epochs: ms of CPU per image (over the same {args.repeats} "
                        f"epochs)", ["data", "pipeline", "this process (the consumer)", "decode workers",
                                     "Ray's other processes", "rest of the machine", "machine busy %"],
                        ["", "", ".2f", ".2f", ".2f", ".2f", ".0f"])
    cpu.notes.append("Every process's CPU time (user + system, sampled every 0.5 s) over the timed epochs. This "
                     "process: Ray Data's iterator threads (the local shuffle, the batches made into tensors) or "
                     "the DataLoader's main process (the benchmark's loop in both). Decode workers: Ray Data's "
                     "read-and-decode tasks, the DataLoader's workers. Ray's other processes: the raylet, the GCS, "
                     "the dashboard, Ray Data's coordinator (also running, idle, in the DataLoader's epochs).")
    for name, loader, variants, used in rows:
        for pipeline in (DATALOADER, "checked"):
            cpu.add(name, "Ray Data, as run" if pipeline == "checked" else pipeline,
                    *(used[pipeline][g] for g in CPU_GROUPS), used[pipeline]["busy"])
        checked, unchecked = variants["checked"], variants["checks off"]
        table.add(name, loader.rate, checked.rate, checked.rate / loader.rate, unchecked.rate,
                  checked.rate / unchecked.rate)
        start.add(name, loader.first_batch_s, checked.first_batch_s, loader.rate_after_first,
                  checked.rate_after_first, checked.rate_after_first / loader.rate_after_first)
        waits.add(name, DATALOADER, loader.first_batch_s, loader.rate, 1.0)
        for variant in (v for v in VARIANTS if v != "checks off"):
            epoch = variants[variant]
            waits.add(name, "Ray Data, as run" if variant == "checked" else f"Ray Data, {variant}",
                      epoch.first_batch_s, epoch.rate, epoch.rate / loader.rate)
    waits.notes.append(f"As run: data.shuffle_buffer {RunConfig().data.shuffle_buffer} rows (Ray Data's local "
                       "shuffle lets out its first batch once it holds 1.5 times that and a batch more), rows in "
                       "their seeded order (a seeded run's batches the same every time), each shard's decoded "
                       "rows one block (let out when the shard is done). No shuffle buffer: data.shuffle_buffer "
                       "0. Any order: ExecutionOptions.preserve_order off. A block per batch: the dataset's "
                       "target_max_block_size one micro-batch's pixels.")
    return [table, start, waits, cpu]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, default=2, help="CPU workers for each pipeline")
    parser.add_argument("--images", type=int, default=8192, help="train images per dataset")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the training run")
    parser.add_argument("--train-images", type=int, default=10_000, help="shapes for the training run (the demo's)")
    parser.add_argument("--val-images", type=int, default=500, help="its val split (the demo's)")
    parser.add_argument("--log-every", type=int, help="the training run's train.log_every_n_steps (default: the "
                        "demo's); a run of few steps needs a smaller one to log its rate")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench_out/ingest"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    shapes = out / "shapes"
    if not (shapes / shards.MANIFEST).exists():
        synth.generate(shapes, num_train=args.images, num_val=200, num_test=0, rows_per_shard=512)
    tables = throughput_tables(args, shapes, out) if not args.skip_throughput else []
    if not args.skip_training:
        demo = synth.ensure(out / f"shapes-demo-{args.train_images}-{args.val_images}", num_train=args.train_images,
                            num_val=args.val_images, num_test=0)
        waits, rate = data_wait(demo, out / "train", args.epochs, args.log_every)
        table = results.Table(f"Training run (demo config: pairsim-tiny, 2 workers × batch 64, {args.train_images} "
                              f"shapes, val {args.val_images}, {rate:.0f} samples/s): share of step time waiting for "
                              f"data (target < 10 %)",
                              ["epoch", "data wait %", "after 1st batch %", "1st batch wait s"], ["d", ".1f", ".1f", ".1f"])
        for epoch, (share, running, first) in enumerate(zip(*waits.values()), start=1):
            table.add(epoch, 100 * share, 100 * running, first)
        tables.append(table)
    results.publish("bench_ingest", tables, args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
