"""Benchmark of sweeps: ASHA against FIFO over the same space and seeds, and a trial's start-up
against a plain run's.

    python benchmarks/bench_tune.py [--num-train 1000] [--trials 8] [--epochs 4] [--out bench_out/tune]

On a shapes dataset (generated in OUT/data if absent), a random search over the Unified loss's
margin and scale (seed 0: both sweeps draw the same points) runs once under FIFO and once under
ASHA (grace 1 epoch, reduction factor 3: rungs at epochs 1 and 3), one trial at a time on a local Ray instance; then
one plain run of the base config on the same instance. Prints each sweep's best val RSUM,
trial-epochs and wall time, and the start-up of a trial (trial start → its first training step,
``perf/startup_s``) against the plain run's (``fit`` called → first step, Ray already up).

Then a trial's start-up by phase (``perf/startup/<phase>_s`` of every trial's MLflow run, see
:class:`pairsim.train.worker.StartupClock`), the medians, and the median trial start-up against
the floor of ``bench_startup.py`` (a fresh process importing torch, deepspeed and open_clip and
building the model), measured in the same run; all of it into the results files.

Targets: ASHA's best within 1 RSUM point of FIFO's with at most half its trial-epochs; a
trial's start-up at most 1.2× a plain run's and at most 3× the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import results
from bench_startup import floor
from pairsim.data import synth
from pairsim.train import driver
from pairsim.tune.space import load_sweep
from pairsim.tune.sweep import run_sweep


def sweep_file(out: Path, data: Path, args: argparse.Namespace, scheduler: str) -> Path:
    path = out / f"{scheduler}.yaml"
    path.write_text(yaml.safe_dump({
        "base": {"config": ["pairsim:demo.yaml"],
                 "data": {"path": str(data), "test_split": None},
                 "train": {"epochs": args.epochs, "log_every_n_steps": 50},
                 "ray": {"storage_path": str(out / "ray")},
                 "tracking": {"tracking_uri": f"sqlite:///{out}/mlflow.db", "experiment": "bench_tune"}},
        "space": {"loss.base.margin": {"uniform": [0.0, 0.4]}, "loss.base.gamma": {"loguniform": [10, 100]}},
        "sweep": {"search": "random", "seed": 0, "num_samples": args.trials, "scheduler": scheduler,
                  "max_concurrent_trials": 1}
        | ({"asha": {"grace_period": 1, "reduction_factor": args.reduction_factor}} if scheduler == "asha" else {})}))
    return path


def startup_seconds(tracking_uri: str, run_id: str) -> float:
    return MlflowClient(tracking_uri).get_metric_history(run_id, "perf/startup_s")[0].value


def startup_phases(tracking_uri: str, run_id: str) -> dict[str, float]:
    """A run's first start-up by phase (a resumed trial logs another at its resume)."""
    client = MlflowClient(tracking_uri)
    keys = {k.removeprefix("perf/startup/").removesuffix("_s"): k for k in client.get_run(run_id).data.metrics
            if k.startswith("perf/startup/")} | {"total": "perf/startup_s"}
    return {phase: min(client.get_metric_history(run_id, key), key=lambda m: m.step).value
            for phase, key in keys.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--reduction-factor", type=float, default=3.0, help="ASHA's: the top 1/rf go on at a rung")
    parser.add_argument("--out", type=Path, default=Path("bench_out/tune"))
    results.add_results_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = synth.ensure(out / f"shapes-{args.num_train}", num_train=args.num_train, num_val=args.num_val, num_test=0)

    floor_seconds = floor()["total"]
    stamp = time.strftime("%H%M%S")
    rows = {}
    for scheduler in ("fifo", "asha"):
        sweep = load_sweep(sweep_file(out, data, args, scheduler))
        sweep_started = time.perf_counter()
        outcome = run_sweep(sweep, f"bench-{scheduler}-{stamp}")
        wall = time.perf_counter() - sweep_started
        startups = [startup_seconds(outcome.tracking_uri, r.run_id) for r in outcome.rows if r.run_id]
        rows[scheduler] = (outcome, wall, startups)

    plain_cfg = sweep.base.model_copy(update={"ray": sweep.base.ray.model_copy(update={"run_name": f"bench-plain-{stamp}"})})
    plain = driver.fit(plain_cfg)
    plain_startup = startup_seconds(plain.tracking_uri, plain.mlflow_run_id)

    sweeps = results.Table(
        f"Shapes {args.num_train} train / {args.num_val} val, {args.trials} trials of up to {args.epochs} epochs, one at "
        f"a time, random search seed 0 over loss.base.margin × loss.base.gamma",
        ["sweep", "best val RSUM", "trial-epochs", "wall s", "stopped early", "median start-up s"],
        ["", ".2f", "d", ".0f", "d", ".1f"])
    for scheduler, (outcome, wall, startups) in rows.items():
        sweeps.add(scheduler, outcome.best.metric, sum(r.epochs for r in outcome.rows), wall,
                   sum(r.status == "stopped early" for r in outcome.rows), statistics.median(startups))
    fifo, asha = rows["fifo"][0], rows["asha"][0]
    trial_startup = statistics.median(rows["fifo"][2] + rows["asha"][2])
    trials = [startup_phases(outcome.tracking_uri, r.run_id) for outcome, _, _ in rows.values()
              for r in outcome.rows if r.run_id]
    phases = list(dict.fromkeys(p for t in trials for p in t if p != "total")) + ["total"]
    median = {p: statistics.median(t[p] for t in trials if p in t) for p in phases}
    targets = results.Table("Against the targets", ["measure", "value", "target"], ["", ".2f", ""])
    targets.add("ASHA best − FIFO best (RSUM)", asha.best.metric - fifo.best.metric, "≥ −1")
    targets.add("ASHA / FIFO trial-epochs", sum(r.epochs for r in asha.rows) / sum(r.epochs for r in fifo.rows), "≤ 0.5")
    targets.add(f"trial start-up / plain run's ({trial_startup:.1f} / {plain_startup:.1f} s)",
                trial_startup / plain_startup, "≤ 1.2")
    targets.add(f"trial start-up / floor ({median['total']:.1f} / {floor_seconds:.1f} s)",
                median["total"] / floor_seconds, "≤ 3")
    by_phase = results.Table(f"Trial start-up by phase, median of {len(trials)} trials", ["phase", "s"], ["", ".1f"])
    for p in phases:
        by_phase.add(p, median[p])
    results.publish("bench_tune", [sweeps, targets, by_phase], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
