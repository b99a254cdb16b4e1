"""CUSA's trade-off (Huang et al., AAAI 2024) as a sweep: the soft-label weights α and β against
cross-modal RSUM and image→image mAP@R at once, with the Pareto front.

    python benchmarks/cusa_tradeoff.py [--init-from MODEL] [--set KEY=VALUE ...] [--name NAME]

Runs ``tune_spaces/cusa_tradeoff.yaml`` — 16 trials of Optuna's multi-objective TPE over
α ∈ [0.01, 1] and β ∈ [0.125, 2] (log-uniform), CUSA on the Unified loss with live teachers (the
student's starting image tower, MiniLM), each trained fully — fine-tuning, as the paper does and
as ``unified_figure5.py`` does: by default from the pretrained base of ``benchmarks/reproduce.py``
on its fine-tuning corpus, into its MLflow store (``--init-from MODEL`` starts from another model;
then give ``--set data.path=DIR`` too). Then evaluates that base as it is on the same val split —
where every trial starts — and writes ``cusa_tradeoff.json`` (the base's metrics and the sweep)
beside the sweep's ``results.csv``, ``pareto.csv`` and ``pareto.png``, logs it to the sweep's
MLflow parent run, and prints and writes into ``--results`` (``cusa_tradeoff.json`` and ``.md``,
see ``results.py``) every trial by its last epoch, front points marked, and the rank correlation
of α and β with each metric: which way each weight trades. ``--set`` takes the sweep file's keys
as ``pairsim tune`` does; ``--name`` of an existing sweep resumes it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pandas as pd

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import reproduce
import results
from pairsim import tracking
from pairsim.tune.results import TrialRow, pareto_front
from pairsim.tune.space import Sweep

SPACE = Path(__file__).resolve().parents[1] / "tune_spaces" / "cusa_tradeoff.yaml"
WEIGHTS = {"loss.cusa.alpha": "α", "loss.cusa.beta": "β"}


def tables(rows: list[TrialRow], sweep: Sweep, base: dict[str, float]) -> list[results.Table]:
    """The base, then every trial best first on the first objective (failed last), front points
    marked; then the Spearman correlation of each weight with each objective over the trials."""
    metrics = [m for m, _ in sweep.objectives]
    front = {r.trial_id for r in pareto_front(rows, sweep.objectives)}
    scored = sorted((r for r in rows if all(m in r.values for m in metrics)), key=lambda r: -r.values[metrics[0]])
    trials = results.Table(
        "CUSA's trade-off (Huang et al.) as a sweep: each trial's last epoch on val, best first on "
        f"{metrics[0]}; the pretrained base it starts from first",
        ["trial", *WEIGHTS.values(), *metrics, "on the Pareto front"], ["", ".3f", ".3f", ".2f", ".2f", ""],
        notes=[f"{len(front)} of {len(scored)} finished trials on the front; {len(rows) - len(scored)} without "
               f"every metric (one trial, one seed, per point: differences within the noise between seeds are "
               f"not resolved)"])
    trials.add("base (as is)", None, None, *(base[m] for m in metrics), "")
    for row in scored + [r for r in rows if r not in scored]:
        trials.add(row.trial_id, *(row.point.get(k) for k in WEIGHTS), *(row.values.get(m) for m in metrics),
                   ("yes" if row.trial_id in front else "no") if row in scored else row.status)
    frame = pd.DataFrame([{**{w: r.point[k] for k, w in WEIGHTS.items()}, **r.values} for r in scored])
    correlation = results.Table(f"Spearman rank correlation over the {len(scored)} finished trials: how each weight "
                                "moves each metric (+1: always up as the weight grows)",
                                ["weight", *metrics], ["", ".2f", ".2f"])
    for weight in WEIGHTS.values():
        correlation.add(weight, *(frame[weight].corr(frame[m], method="spearman") for m in metrics))
    return [trials, correlation]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args, sweep, outcome = reproduce.research_sweep(SPACE, __doc__, argv)
    val = reproduce.evaluate_export(Path(sweep.base.model.init_from), sweep.base, ("val",))["val"]
    base = {m: val[m.removeprefix("val/")] for m, _ in sweep.objectives}
    summary = outcome.out_dir / "cusa_tradeoff.json"
    summary.write_text(json.dumps({"sweep": outcome.name, "base_model": str(sweep.base.model.init_from), "base": base,
                                   "objectives": sweep.objectives}, indent=2))
    with tracking.RunLogger(outcome.tracking_uri, outcome.parent_run_id) as run:
        run.log_artifact(summary)
    results.publish("cusa_tradeoff", tables(outcome.rows, sweep, base), args.results, time.perf_counter() - started)
    print(f"\nsweep {outcome.name}: {len(outcome.rows)} trials; results.csv, pareto.csv, pareto.png and "
          f"cusa_tradeoff.json in {outcome.out_dir} and on MLflow run {outcome.parent_run_id} ({outcome.tracking_uri})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
