"""Training throughput: pairsim (1 Ray Train worker, DeepSpeed ZeRO-0, fp32) against open_clip's
own training script (``open_clip_train``) on the same tiny model, data and batch size, in one run.

    python benchmarks/bench_train.py [--images 6400] [--batch-size 64] [--threads 2]

The shapes data is generated once, then exported to the tab-separated CSV + image files that
``open_clip_train`` reads. Both tools get the same compute threads and one data worker.
Steady-state samples/s is the median over logging windows after the first 10 steps; start-up
is the time from launching the tool until its first training step has finished.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from pairsim.data import shards, synth

WARMUP_STEPS = 10


def export_csv(dataset: Path, out: Path) -> Path:
    """open_clip's CSV form of the train split: one row per image with its first caption."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    table = out / "train.csv"
    with table.open("w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        for shard in shards.split_files(dataset, "train"):
            for row in pq.read_table(shard, columns=["image", "image_id", "captions"]).to_pylist():
                path = images / f"{row['image_id']}.png"
                path.write_bytes(row["image"])
                writer.writerow([str(path), row["captions"][0]])
    return table


def run_open_clip_train(table: Path, out: Path, batch_size: int, threads: int, num_samples: int):
    """Run ``open_clip_train.main`` with pairsim's tiny architecture registered; parse its log."""
    args = ["--train-data", str(table), "--dataset-type", "csv", "--csv-img-key", "filepath",
            "--csv-caption-key", "title", "--model", "pairsim-tiny", "--batch-size", str(batch_size),
            "--epochs", "1", "--workers", "1", "--device", "cpu", "--precision", "fp32", "--lr", "1e-3",
            "--warmup", "10", "--wd", "0.1", "--log-every-n-steps", "1", "--save-frequency", "0",
            "--zeroshot-frequency", "0", "--val-frequency", "0", "--logs", str(out / "open_clip_logs"),
            "--name", datetime.now().strftime("bench-%H%M%S"), "--train-num-samples", str(num_samples)]
    code = ("import sys, pairsim.models.clip; from open_clip_train.main import main; main(sys.argv[1:])")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"open_clip_train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log = proc.stdout + proc.stderr
    pattern = r"(\d{4}-\d\d-\d\d,\d\d:\d\d:\d\d) \| INFO \| Train Epoch: \d+ \[\s*(\d+)/.*?, ([\d.]+)/s, "
    steps = [(datetime.strptime(t, "%Y-%m-%d,%H:%M:%S").timestamp(), int(n) // batch_size, float(r))
             for t, n, r in re.findall(pattern, log)]
    if len(steps) <= WARMUP_STEPS:
        raise RuntimeError(f"open_clip_train logged {len(steps)} steps:\n{log[-3000:]}")
    first_step_at = next(t for t, n, _ in steps if n >= 1)
    steady = statistics.median(r for _, n, r in steps if n > WARMUP_STEPS)
    return steady, first_step_at - start, wall


def run_pairsim(dataset: Path, out: Path, batch_size: int, threads: int):
    from mlflow.tracking import MlflowClient

    from pairsim.train import driver
    from pairsim.config import load_config

    cfg = load_config(None, [
        f"data.path={dataset}", "model.arch=pairsim-tiny", "train.num_workers=1",
        f"train.cpus_per_worker={threads}", "ray.data_cpus=1", "train.zero_stage=0", "train.precision=fp32",
        f"train.micro_batch_size={batch_size}", "train.epochs=1", "train.log_every_n_steps=5",
        "optim.lr=1e-3", "optim.warmup_steps=10", "optim.weight_decay=0.1",
        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", f"ray.storage_path={out}/ray"])
    start = time.time()
    result = driver.fit(cfg)
    wall = time.time() - start
    client = MlflowClient(result.tracking_uri)
    rates = client.get_metric_history(result.mlflow_run_id, "train/samples_per_s")
    steady = statistics.median(m.value for m in rates if m.step > WARMUP_STEPS)
    first = min(rates, key=lambda m: m.step)
    # the first logged window ends at step 5: back out the time of step 1 from its rate
    first_step_at = first.timestamp / 1000 - (first.step - 1) * batch_size / first.value
    return steady, first_step_at - start, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="compute threads for each tool")
    parser.add_argument("--out", type=Path, default=Path("bench_out/train"))
    args = parser.parse_args()
    out = args.out.resolve()
    dataset = out / "shapes"
    if not (dataset / shards.MANIFEST).exists():
        synth.generate(dataset, num_train=args.images, num_val=200, num_test=0)
    table = out / "csv" / "train.csv"
    if not table.exists():
        export_csv(dataset, out / "csv")

    oc_rate, oc_start, oc_wall = run_open_clip_train(table, out, args.batch_size, args.threads, args.images)
    ps_rate, ps_start, ps_wall = run_pairsim(dataset, out, args.batch_size, args.threads)

    print(f"\ntraining throughput, pairsim-tiny, batch {args.batch_size}, {args.images} images, "
          f"{args.threads} compute threads + 1 data worker each")
    print(f"{'tool':<34}{'steady samples/s':>18}{'ratio':>8}{'start-up s':>12}{'wall s':>9}")
    print(f"{'open_clip_train (baseline)':<34}{oc_rate:>18.1f}{1.0:>8.2f}{oc_start:>12.1f}{oc_wall:>9.1f}")
    print(f"{'pairsim (1 worker, ZeRO-0, fp32)':<34}{ps_rate:>18.1f}{ps_rate / oc_rate:>8.2f}"
          f"{ps_start:>12.1f}{ps_wall:>9.1f}")


if __name__ == "__main__":
    main()
