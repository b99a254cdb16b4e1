"""Benchmark of a run's start-up: where it goes, phase by phase, against the floor.

    python benchmarks/bench_startup.py [--runs 3] [--out bench_out/startup]

The floor: a fresh Python process that imports torch, deepspeed and open_clip and builds the
demo config's model (what any worker must do before its first step), timed from launch to the
model built (not its exit), and step by step (:data:`FLOOR_STEPS`: each import, the model).
Then ``--runs`` plain runs of the demo config for one epoch (256 train scenes at 64 px, 2 workers,
checkpoints and MLflow under OUT) on one local Ray instance started beforehand, as a sweep's
trials or a test session's runs find it. Prints each run's ``perf/startup/<phase>_s`` (see
:class:`pairsim.train.worker.StartupClock`), the medians, and the median start-up
(``perf/startup_s``: ``fit`` called → first step done) over the floor, into the results files. The first run also pays for Ray's idle worker processes importing
torch: the medians are over the later runs when there are more than one.

``worker_group``, the largest phase, is split further by the Ray tasks of Train's controller and
workers in Ray's task timeline (``ray.timeline()``): see :data:`WORKER_GROUP_STEPS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from pairsim.cli import DEMO_CONFIG
from pairsim.config import load_config
from pairsim.data import synth
from pairsim.train import driver
from pairsim.cluster import start_local_instance

# the floor step by step: (step, its code), run in this order in one fresh process
FLOOR_STEPS = (
    ("import torch", "import torch"),
    ("import deepspeed", "import deepspeed"),
    ("import torchvision (open_clip's; it loads torch._dynamo)", "import torchvision"),
    ("import open_clip (the rest)", "import open_clip"),
    ("pairsim: config and the demo's model", "from pairsim.config import load_config; from pairsim.cli import DEMO_CONFIG; "
     "from pairsim.models import retrieval; retrieval.create_retrieval_model(load_config(DEMO_CONFIG).model)"),
)


DRIVER_PHASES = ("checks", "ray", "mlflow", "datasets")  # lapped by pairsim.train.driver before TorchTrainer.fit

# the worker_group phase step by step: (step, the timeline mark that ends it). A mark is ("start",
# task) for the first start of a Ray task (class.method) in the phase, ("end", task) for the last
# end, or None for the phase's end (the training loop's first line)
WORKER_GROUP_STEPS = (
    ("controller process starts", ("start", "TrainController.__init__")),
    ("controller __init__ (unpickling its arguments)", ("end", "TrainController.__init__")),
    ("placement group, worker processes start", ("start", "RayTrainWorker.__init__")),
    ("workers' __init__, init_train_context (unpickling: torch)", ("end", "RayTrainWorker.init_train_context")),
    ("process group (TorchConfig)", ("start", "RayTrainWorker.run_train_fn")),
    ("run_train_fn to the loop's first line (unpickling the loop: DeepSpeed, open_clip)", None),
)


def worker_group_steps(events: list[dict], begin: float, end: float) -> dict[str, float]:
    """Seconds of each of :data:`WORKER_GROUP_STEPS` in ``[begin, end]`` (the run's worker_group
    phase, epoch seconds), from Ray's task timeline events."""
    starts: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and begin <= e["ts"] / 1e6 <= end:
            task = e["cat"].removeprefix("task::")
            starts.setdefault(task, []).append(e["ts"] / 1e6)
            ends.setdefault(task, []).append((e["ts"] + e["dur"]) / 1e6)
    marks = [begin]
    for step, mark in WORKER_GROUP_STEPS:
        if mark is None:
            marks.append(end)
            continue
        edge, task = mark
        if task not in starts:
            raise SystemExit(f"worker_group: no {task} task in Ray's timeline ({step}); task events off?")
        marks.append(min(starts[task]) if edge == "start" else max(ends[task]))
    return {step: after - before for (step, _), before, after in zip(WORKER_GROUP_STEPS, marks, marks[1:])}


def floor() -> dict[str, float]:
    """Seconds of each step of the floor (the interpreter's start and :data:`FLOOR_STEPS`), and
    ``total``: launch to the model built. The interpreter's exit is timed too, not counted: a
    worker does not exit before its first step (tearing down these modules takes ~1.4 s)."""
    code = "\n".join(["import json, time", "marks = [time.time()]",
                      *(f"{line}; marks.append(time.time())" for _, line in FLOOR_STEPS),
                      "print('FLOOR-MARKS', json.dumps(marks))"])
    launched = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    ended = time.time()
    if done.returncode:
        raise SystemExit(f"the floor's process failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    marks = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FLOOR-MARKS "))
                       .removeprefix("FLOOR-MARKS "))
    steps = {"interpreter start": marks[0] - launched}
    steps |= {step: after - before for (step, _), before, after in zip(FLOOR_STEPS, marks, marks[1:])}
    return steps | {"total": marks[-1] - launched, "interpreter exit (not counted)": ended - marks[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/startup"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = synth.ensure(out / "shapes-256", num_train=256, num_val=48, num_test=0)

    floor_steps = floor()
    floor_seconds = floor_steps["total"]
    start_local_instance(num_cpus=4)
    stamp = time.strftime("%H%M%S")
    runs, splits = [], []
    for i in range(args.runs):
        cfg = load_config(DEMO_CONFIG, [f"data.path={data}", "data.test_split=null", "train.epochs=1",
                                        f"ray.run_name=startup-{stamp}-{i}", f"ray.storage_path={out}/ray",
                                        f"tracking.tracking_uri=sqlite:///{out}/mlflow.db"])
        fit_called = time.time()
        result = driver.fit(cfg)
        metrics = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.metrics
        run = {k.removeprefix("perf/startup/").removesuffix("_s"): v for k, v in metrics.items()
               if k.startswith("perf/startup/")}
        begin = fit_called + sum(run[phase] for phase in DRIVER_PHASES)
        splits.append(worker_group_steps(ray.timeline(), begin, begin + run["worker_group"]))
        runs.append(run | {"total": metrics["perf/startup_s"]})
    counted = runs[1:] or runs
    phases = list(counted[0])
    median = {p: statistics.median(r[p] for r in counted) for p in phases}

    ratio = median["total"] / floor_seconds
    table = results.Table(f"Start-up of {args.runs} runs (demo config, 1 epoch, warm local instance) by phase, s; "
                          f"floor {floor_seconds:.1f} s (imports + model in a fresh process)",
                          ["phase", *(f"run {i}" for i in range(len(runs))), "median"], ["", *[".1f"] * (len(runs) + 1)])
    for p in phases:
        table.add(p, *(r[p] for r in runs), median[p])
    table.notes.append(f"Median start-up / floor: {ratio:.2f}× (target ≤ 3×)"
                       + (f"; the median is over runs 1–{len(runs) - 1}, run 0 pays for Ray's idle workers' imports."
                          if len(runs) > 1 else "; one run: cold."))
    by_task = results.Table("worker_group step by step, s (Ray's task timeline: Train's controller and workers)",
                            ["step", *(f"run {i}" for i in range(len(runs))), "median"],
                            ["", *[".1f"] * (len(runs) + 1)])
    for step, _ in WORKER_GROUP_STEPS:
        by_task.add(step, *(split[step] for split in splits), statistics.median(split[step] for split in splits[1:] or splits))
    floor_table = results.Table("The floor step by step, s (one fresh process: its steps timed from inside, its launch "
                                "and exit from outside)", ["step", "s"], ["", ".2f"])
    for step, seconds in floor_steps.items():
        floor_table.add(step, seconds)
    results.publish("bench_startup", [table, by_task, floor_table], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
