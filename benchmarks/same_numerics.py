"""Do commits train bit for bit alike? Finds the commit that moved a seeded figure.

    python benchmarks/same_numerics.py e4adc51 9b18b8e 44ffbf4 bf3aed6 [--work /tmp/same_numerics]

A seeded run repeats to the last digit at one commit on one machine; a commit that computes the
same arithmetic in another order (a normalisation moved, a loss path rewritten) changes the
rounding, and the change grows over epochs into figures that differ in their first decimals.
For each commit this checks it out in a git worktree under ``--work`` and, with that commit's
own pairsim, generates 1,500 shapes scenes (data seed 1, as the reproduction's pretraining
corpus) and trains 2 epochs of the reproduction's pretraining config (``demo.yaml`` +
``objectives/infonce.yaml`` + ``reproduce/pretrain.yaml``: 22 steps, 2 DeepSpeed workers), with
the training loss logged at every step. The table gives each commit's val RSUM and whether its
22 losses equal the first commit's and the previous commit's exactly (the first step that
differs from the first's and both values, when not). Each run takes 2–3 min on the 2-core
machine; a commit whose finished run is already in ``--work`` is not trained again. The commits
must have ``platform/pairsim/configs/reproduce/pretrain.yaml`` (9be6183 on). The table goes to
``bench_out/same_numerics/`` (not ``benchmarks/results/``, which holds ``bench_all``'s files alone).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

import results

CONFIGS = ("demo.yaml", "objectives/infonce.yaml", "reproduce/pretrain.yaml")


def train_at(commit: str, work: Path) -> tuple[list[float], float]:
    """The per-step training losses and the last val RSUM of the short run at ``commit`` (the run
    already in its worktree's MLflow store, else a new one)."""
    tree = work / commit
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(tree), commit], cwd=results.REPO, check=True)
    env = os.environ | {"PYTHONPATH": str(tree / "platform"), "MLFLOW_TRACKING_URI": f"sqlite:///{tree}/mlflow.db"}
    if not (outcome := finished_run(env["MLFLOW_TRACKING_URI"])):
        pairsim = [sys.executable, "-m", "pairsim.cli"]
        if not (tree / "data").exists():
            subprocess.run([*pairsim, "data", "synth", "--out", str(tree / "data"), "--num-train", "1500", "--num-val",
                            "200", "--num-test", "50", "--seed", "1"], cwd=tree, env=env, check=True, capture_output=True)
        configs = [arg for name in CONFIGS for arg in ("--config", str(tree / "platform/pairsim/configs" / name))]
        log = tree / "train.log"
        with log.open("w") as out:
            if subprocess.run([*pairsim, "train", *configs, "--set", f"data.path={tree / 'data'}", "--set",
                               "train.epochs=2", "--set", "train.log_every_n_steps=1"],
                              cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"{commit}: training failed, see {log}")
        outcome = finished_run(env["MLFLOW_TRACKING_URI"])
    return outcome


def finished_run(uri: str) -> tuple[list[float], float] | None:
    """(training losses by step, val RSUM) of the store's finished run, if it has one."""
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    history = sorted(client.get_metric_history(runs[0].info.run_id, "train/loss"), key=lambda m: m.step)
    return [m.value for m in history], runs[0].data.metrics["val/rsum"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs="+", help="commits, the first the reference")
    parser.add_argument("--work", type=Path, default=Path("/tmp/same_numerics"), help="worktrees and their runs")
    parser.add_argument("--results", type=Path, default=results.REPO / "bench_out" / "same_numerics",
                        help="where the JSON and Markdown go (default bench_out/same_numerics/: a diagnosis, not one of "
                             "bench_all's results; copy the JSON to docs/results/ when the docs cite it)")
    args = parser.parse_args()
    started = time.perf_counter()
    table = results.Table("A short seeded run at each commit (2 epochs, 22 steps of the pretraining config, "
                          "1,500 scenes), against the first commit's",
                          ["commit", "subject", "val RSUM", "losses as the previous's", "as the first's",
                           "first step unlike the first's", "loss there", "first's loss there"],
                          ["", "", ".2f", "", "", "", "", ""])
    reference: list[float] | None = None
    previous: list[float] | None = None
    for commit in args.commits:
        losses, rsum = train_at(commit, args.work)
        subject = subprocess.run(["git", "show", "-s", "--format=%s", commit], cwd=results.REPO, capture_output=True,
                                 text=True, check=True).stdout.strip()
        reference = losses if reference is None else reference
        differ = next((i for i, (a, b) in enumerate(zip(losses, reference)) if a != b), None)
        if differ is None and len(losses) != len(reference):
            differ = min(len(losses), len(reference))
        same = "yes" if differ is None else "no"
        table.add(commit, subject[:60] + ("…" if len(subject) > 60 else ""), rsum,
                  None if previous is None else ("yes" if losses == previous else "no"), same,
                  None if differ is None else differ + 1,
                  None if differ is None or differ >= len(losses) else repr(losses[differ]),
                  None if differ is None or differ >= len(reference) else repr(reference[differ]))
        print(f"{commit}: val RSUM {rsum:.2f}, losses as the first's: {same}", flush=True)
        previous = losses
    results.publish("same_numerics", [table], args.results, time.perf_counter() - started)


if __name__ == "__main__":
    main()
