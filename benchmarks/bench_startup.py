"""Benchmark of a run's start-up: where it goes, phase by phase, against the floor.

    python benchmarks/bench_startup.py [--runs 3] [--out bench_out/startup]

The floor: a fresh Python process that imports torch, deepspeed and open_clip and builds the
demo config's model (what any worker must do before its first step), timed from launch to exit.
Then ``--runs`` plain runs of the demo config for one epoch (256 train scenes at 64 px, 2 workers,
checkpoints and MLflow under OUT) on one local Ray instance started beforehand, as a sweep's
trials or a test session's runs find it. Prints each run's ``perf/startup/<phase>_s`` (see
:class:`pairsim.train.worker.StartupClock`), the medians, and the median start-up
(``perf/startup_s``: ``fit`` called → first step done) over the floor; writes them with the
commit to OUT/startup.json. The first run also pays for Ray's idle worker processes importing
torch: the medians are over the later runs when there are more than one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim import tracking
from pairsim.cli import DEMO_CONFIG
from pairsim.config import load_config
from pairsim.data import synth
from pairsim.train import driver
from pairsim.cluster import start_local_instance

FLOOR = ("import torch, deepspeed, open_clip; from pairsim.config import load_config; from pairsim.cli import DEMO_CONFIG; "
         "from pairsim.models import retrieval; retrieval.create_retrieval_model(load_config(DEMO_CONFIG).model)")


def floor_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/startup"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = synth.ensure(out / "shapes-256", num_train=256, num_val=48, num_test=0)

    floor = floor_seconds()
    start_local_instance(num_cpus=4)
    stamp = time.strftime("%H%M%S")
    runs = []
    for i in range(args.runs):
        cfg = load_config(DEMO_CONFIG, [f"data.path={data}", "data.test_split=null", "train.epochs=1",
                                        f"ray.run_name=startup-{stamp}-{i}", f"ray.storage_path={out}/ray",
                                        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db"])
        result = driver.fit(cfg)
        metrics = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.metrics
        runs.append({k.removeprefix("perf/startup/").removesuffix("_s"): v for k, v in metrics.items()
                     if k.startswith("perf/startup/")} | {"total": metrics["perf/startup_s"]})
    counted = runs[1:] or runs
    phases = list(counted[0])
    median = {p: statistics.median(r[p] for r in counted) for p in phases}

    print(f"\nstart-up of {args.runs} runs (demo config, 1 epoch, warm local instance); floor {floor:.1f} s\n")
    print(f"{'phase':<16}" + "".join(f"{'run ' + str(i):>9}" for i in range(len(runs))) + f"{'median':>9}")
    for p in phases:
        print(f"{p:<16}" + "".join(f"{r[p]:9.1f}" for r in runs) + f"{median[p]:9.1f}")
    ratio = median["total"] / floor
    print(f"\nmedian start-up / floor: {ratio:.2f}× (target ≤ 3×)" + ("" if len(runs) > 1 else " (one run: cold)"))
    commit = tracking.context_tags()[MLFLOW_GIT_COMMIT]
    (out / "startup.json").write_text(json.dumps({"commit": commit, "floor_s": floor, "runs": runs, "median": median,
                                                  "ratio_to_floor": ratio}, indent=2))
    print(f"written: {out / 'startup.json'} (commit {commit})")


if __name__ == "__main__":
    main()
