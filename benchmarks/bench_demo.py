"""The demo's figures, as the README and the Quick start show them: ``pairsim demo`` (the README's
first command, less its install) in a new directory, timed from launch to exit (the data's
generation included), then its MLflow run read back: val RSUM per epoch, the val metrics by
direction and the modality grid at the best epoch (the checkpoint the run keeps and exports),
and the test split's with that checkpoint.

    python benchmarks/bench_demo.py [--out bench_out/demo] [--set KEY=VALUE ...]

Seeded runs repeat to the last digit on one set of installed packages, so these are the
figures a newcomer's run prints; ``--set`` passes overrides to the demo (the quick profile
trains one epoch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim.cli import DEMO_CONFIG
from pairsim.config import load_config
from pairsim.data import shards
from pairsim.tracking import metric_key

DIRECTIONS = {"i2t": "image→text", "t2i": "text→image", "i2i": "image→image", "t2t": "text→text"}
COLUMNS = {"R@1": ".2f", "R@5": ".2f", "R@10": ".2f", "mAP@R": ".2f", "R-P": ".2f", "median_rank": ".1f"}
MODALITIES = ("image", "text", "fused")
EPOCH_COSTS = {"perf/train_epoch_s": "train s", "perf/val_s": "val s", "perf/val_share": "val / train",
               "perf/gpu_peak_memory_gib": "peak GPU GiB"}
PLATFORM = Path(__file__).resolve().parents[1] / "platform"


def by_direction(title: str, metrics: dict[str, float], prefix: str) -> results.Table:
    table = results.Table(title, ["direction", *COLUMNS], ["", *COLUMNS.values()])
    for key, name in DIRECTIONS.items():
        table.add(name, *(metrics[metric_key(f"{prefix}/{key}_{column}")] for column in COLUMNS))
    table.notes.append(f"RSUM {metrics[f'{prefix}/rsum']:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/demo"), help="emptied, then the demo's directory")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    results.add_results_argument(parser)
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLATFORM), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from pairsim.cli import main; sys.exit(main())", "demo",
                    *(arg for override in args.overrides for arg in ("--set", override))], cwd=out, env=env, check=True)
    seconds = time.perf_counter() - started

    tables = read_tables(out, seconds)
    results.publish("bench_demo", tables, args.results, seconds,
                    on_gpu=load_config(DEMO_CONFIG, args.overrides).train.use_gpu)


def read_tables(out: Path, seconds: float) -> list[results.Table]:
    """The tables of the demo run in ``out`` (its MLflow store and data), which took ``seconds``."""
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run, = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/rsum")}
    steps = sorted(history)
    best = max(steps, key=lambda step: history[step])
    val = {key: next(m.value for m in client.get_metric_history(run.info.run_id, key) if m.step == best)
           for key in run.data.metrics if key.startswith("val/")}

    def per_step(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    costs = {key: per_step(key) for key in EPOCH_COSTS}
    epochs = results.Table(f"`pairsim demo`: {minutes(seconds)} from launch to exit; val RSUM after each epoch, "
                           "the epoch's training and validation seconds", ["epoch", "val RSUM", *EPOCH_COSTS.values()],
                           ["d", ".2f", ".1f", ".1f", ".3f", ".2f"])
    for epoch, step in enumerate(steps, start=1):
        epochs.add(epoch, history[step], *(costs[key].get(step) for key in EPOCH_COSTS))
    epoch = steps.index(best) + 1
    manifest = shards.read_manifest(out / "data" / "shapes")  # where the demo config puts its data
    sizes = {split: f"{info.images:,} images, {info.captions:,} captions" for split, info in manifest.splits.items()}
    tables = [epochs, by_direction(f"Validation after epoch {epoch}, the best ({sizes['val']})", val, "val")]
    grid = results.Table(f"Modality grid after epoch {epoch}: R@1 of queries of one kind (rows) over keys of another",
                         ["query", *MODALITIES], ["", *[".2f"] * len(MODALITIES)])
    for query in MODALITIES:
        grid.add(query, *(val[metric_key(f"val/grid_{query}2{key}_R@1")] for key in MODALITIES))
    tables.append(grid)
    if "test/rsum" in run.data.metrics:
        tables.append(by_direction(f"Test with epoch {epoch}'s checkpoint ({sizes['test']})", run.data.metrics, "test"))
    return tables


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


if __name__ == "__main__":
    main()
