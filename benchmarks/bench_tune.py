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

Last, warm trials against cold ones: a PBT sweep (perturbation every epoch, the margin
mutated) with one worker per trial, run cold (a ``TorchTrainer`` per trial) and then warm
(``sweep.warm``: each trial trained in its Tune trial actor, reused for the next): wall time,
and each trial's first start-up — of the warm sweep, the first trial an actor ran apart from
the later ones — against the floor.

Targets: ASHA's best within 1 RSUM point of FIFO's with at most half its trial-epochs; a
trial's start-up at most 1.2× a plain run's and at most 3× the floor; later warm trials' at
most 1.5× the floor, the warm sweep's median at most 2×.
"""

from __future__ import annotations

import argparse
import copy
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
from pairsim.tune.trial import PROCESS_TAG


SPACE = {"loss.base.margin": {"uniform": [0.0, 0.4]}, "loss.base.gamma": {"loguniform": [10, 100]}}
PBT = {"perturbation_interval": 1, "quantile_fraction": 0.5, "mutations": {"loss.base.margin": SPACE["loss.base.margin"]}}


def sweep_file(out: Path, data: Path, args: argparse.Namespace, scheduler: str, warm: bool | None = None) -> Path:
    """The sweep of ``scheduler``; ``warm`` given: one worker per trial, trained warm or cold."""
    path = out / f"{scheduler}{'' if warm is None else '-warm' if warm else '-cold'}.yaml"
    settings = {"search": "random", "seed": 0, "num_samples": args.trials, "scheduler": scheduler,
                "max_concurrent_trials": 1}
    if scheduler == "asha":
        settings["asha"] = {"grace_period": 1, "reduction_factor": args.reduction_factor}
    if scheduler == "pbt":
        settings["pbt"] = copy.deepcopy(PBT)  # shares no object with SPACE: YAML would write an alias, which is refused
    if warm is not None:
        settings |= {"warm": warm, "resources": {"num_workers": 1, "cpus_per_worker": 1}}
    path.write_text(yaml.safe_dump({
        "base": {"config": ["pairsim:demo.yaml"],
                 "data": {"path": str(data), "test_split": None},
                 "train": {"epochs": args.epochs, "log_every_n_steps": 50},
                 "ray": {"storage_path": str(out / "ray")},
                 "tracking": {"tracking_uri": f"sqlite:///{out}/mlflow.db", "experiment": "bench_tune"}},
        "space": copy.deepcopy(SPACE), "sweep": settings}))
    return path


def warm_against_cold(out: Path, data: Path, args: argparse.Namespace, stamp: str, floor_seconds: float):
    """The PBT sweep with one worker per trial, cold (a TorchTrainer per trial) then warm (each
    trial in its reused Tune trial actor): wall time, and each trial's first start-up — of a warm
    sweep the first trial an actor ran apart from the later ones — against the floor."""
    sweeps = results.Table(
        f"PBT, {args.trials} trials of {args.epochs} epochs, one worker each, one at a time (perturbation every "
        "epoch): cold against warm",
        ["sweep", "best val RSUM", "wall s", "actors", "first trial on an actor: start-up s",
         "later trials: median start-up s", "all trials: median start-up s"],
        ["", ".2f", ".0f", "d", ".1f", ".1f", ".1f"])
    measured = {}
    for warm in (False, True):
        sweep = load_sweep(sweep_file(out, data, args, "pbt", warm))
        started = time.perf_counter()
        outcome = run_sweep(sweep, f"bench-pbt-{'warm' if warm else 'cold'}-{stamp}")
        wall = time.perf_counter() - started
        client = MlflowClient(outcome.tracking_uri)
        runs = sorted((client.get_run(r.run_id) for r in outcome.rows if r.run_id), key=lambda run: run.info.start_time)
        first_on_actor, later, seen = [], [], set()
        for run in runs:
            process = run.data.tags.get(PROCESS_TAG, run.info.run_id)  # a cold trial: a process group of its own
            (later if process in seen else first_on_actor).append(startup_phases(outcome.tracking_uri, run.info.run_id)["total"])
            seen.add(process)
        every = first_on_actor + later
        sweeps.add("warm" if warm else "cold", outcome.best.metric, wall, len(seen), statistics.median(first_on_actor),
                   statistics.median(later) if later else None, statistics.median(every))
        measured[warm] = (wall, later, every)
    targets = results.Table("Warm trials against the targets", ["measure", "value", "target"], ["", ".2f", ""])
    (cold_wall, _, cold_every), (warm_wall, warm_later, warm_every) = measured[False], measured[True]
    if warm_later:
        targets.add(f"later warm trials' start-up / floor ({statistics.median(warm_later):.1f} / {floor_seconds:.1f} s)",
                    statistics.median(warm_later) / floor_seconds, "≤ 1.5")
    targets.add(f"warm sweep's median start-up / floor ({statistics.median(warm_every):.1f} / {floor_seconds:.1f} s)",
                statistics.median(warm_every) / floor_seconds, "≤ 2")
    targets.add(f"cold sweep's median start-up / floor ({statistics.median(cold_every):.1f} / {floor_seconds:.1f} s)",
                statistics.median(cold_every) / floor_seconds, "(before)")
    targets.add(f"warm sweep's wall time / cold's ({warm_wall:.0f} / {cold_wall:.0f} s)", warm_wall / cold_wall, "< 1")
    return [sweeps, targets]


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
    warm = warm_against_cold(out, data, args, stamp, floor_seconds)
    results.publish("bench_tune", [sweeps, targets, by_phase, *warm], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
