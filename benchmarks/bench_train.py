"""Training throughput: pairsim (1 Ray Train worker, DeepSpeed ZeRO-0, fp32) against open_clip's
own training script (``open_clip_train``) on the same tiny model, data and batch size, in one run.

    python benchmarks/bench_train.py [--images 6400] [--batch-size 64] [--threads 2]

The shapes data is generated once, then exported to the tab-separated CSV + image files that
``open_clip_train`` reads. Both tools get the same compute threads and one data worker, each in
its own process tree started from here, and both log every 5 steps. Steady-state samples/s is
the median, over the 5-step logging windows that start after step 10, of the window's samples
over its time — each tool's own figure for it: pairsim's ``train/samples_per_s``,
open_clip_train's batch size over its "Batch (t)" (the mean step time since its last log line;
its "/s" figure is the last step's alone). Both windows hold the data waits and the logging of
the previous line. Start-up is the time from launching the tool until its first training step
has finished (open_clip_train's first log line; pairsim's ``perf/startup_s``, logged then).
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

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results

from pairsim.data import shards, synth

WARMUP_STEPS = 10
LOG_EVERY = 5


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
            "--warmup", "10", "--wd", "0.1", "--log-every-n-steps", str(LOG_EVERY), "--save-frequency", "0",
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
    pattern = r"(\d{4}-\d\d-\d\d,\d\d:\d\d:\d\d) \| INFO \| Train Epoch: \d+ \[\s*(\d+)/.*?Batch \(t\): ([\d.]+),"
    windows = [(datetime.strptime(t, "%Y-%m-%d,%H:%M:%S").timestamp(), int(n) // batch_size, batch_size / float(b))
               for t, n, b in re.findall(pattern, log)]
    steady = [rate for _, end, rate in windows if end - LOG_EVERY + 1 > WARMUP_STEPS]
    if not steady:
        raise RuntimeError(f"open_clip_train logged {len(windows)} windows:\n{log[-3000:]}")
    return statistics.median(steady), windows[0][0] - start, wall


def run_pairsim(dataset: Path, out: Path, batch_size: int, threads: int):
    from mlflow.tracking import MlflowClient

    from pairsim.train import driver
    from pairsim.config import load_config

    cfg = load_config(None, [
        f"data.path={dataset}", "model.arch=pairsim-tiny", "train.num_workers=1",
        f"train.cpus_per_worker={threads}", "ray.data_cpus=1", "train.zero_stage=0", "train.precision=fp32",
        f"train.micro_batch_size={batch_size}", "train.epochs=1", f"train.log_every_n_steps={LOG_EVERY}",
        "optim.lr=1e-3", "optim.warmup_steps=10", "optim.weight_decay=0.1",
        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db", f"ray.storage_path={out}/ray"])
    start = time.time()
    result = driver.fit(cfg)
    wall = time.time() - start
    client = MlflowClient(result.tracking_uri)
    rates = client.get_metric_history(result.mlflow_run_id, "train/samples_per_s")
    steady = statistics.median(m.value for m in rates if m.step - LOG_EVERY + 1 > WARMUP_STEPS)
    first_step_at = client.get_metric_history(result.mlflow_run_id, "perf/startup_s")[0].timestamp / 1000
    return steady, first_step_at - start, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="compute threads for each tool")
    parser.add_argument("--out", type=Path, default=Path("bench_out/train"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    dataset = out / "shapes"
    if not (dataset / shards.MANIFEST).exists():
        synth.generate(dataset, num_train=args.images, num_val=200, num_test=0)
    table = out / "csv" / "train.csv"
    if not table.exists():
        export_csv(dataset, out / "csv")

    oc_rate, oc_start, oc_wall = run_open_clip_train(table, out, args.batch_size, args.threads, args.images)
    ps_rate, ps_start, ps_wall = run_pairsim(dataset, out, args.batch_size, args.threads)

    table = results.Table(
        f"Training throughput: pairsim-tiny, batch {args.batch_size}, {args.images} images, 1 epoch, "
        f"{args.threads} compute threads + 1 data worker each",
        ["tool", "steady samples/s", "ratio", "start-up s", "wall s"], ["", ".1f", ".2f", ".1f", ".1f"])
    table.add("open_clip_train (baseline)", oc_rate, 1.0, oc_start, oc_wall)
    table.add("pairsim (1 worker, ZeRO-0, fp32)", ps_rate, ps_rate / oc_rate, ps_start, ps_wall)
    table.notes.append(f"Steady: the median rate over the {LOG_EVERY}-step logging windows after step {WARMUP_STEPS}. "
                       "pairsim's wall time also holds Ray's start, a val evaluation and a checkpoint, which the "
                       "baseline was told to skip.")
    results.publish("bench_train", [table], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
