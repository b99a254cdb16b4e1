"""The Unified paper's Figure 5 (Li et al., arXiv 2209.13869, §4.5) as a sweep, with a verdict
on each of its statements.

    python benchmarks/unified_figure5.py [--init-from MODEL] [--set KEY=VALUE ...] [--name NAME]

Runs ``tune_spaces/unified_figure5.yaml`` — val RSUM at m ∈ {0, 0.1, 0.2, 0.3, 0.4} with γ = 60
and at γ ∈ {20, 40, 60, 80, 100} with m = 0.2, 9 trials, each trained fully — fine-tuning, as
the paper does: by default from the pretrained base of ``benchmarks/reproduce.py`` (made there,
or found in its cache under ``--out``) on its fine-tuning corpus, into its MLflow store;
``--init-from MODEL`` starts from another model (then give ``--set data.path=DIR`` too). Then draws the two curves with
the paper's three statements and a verdict each (:mod:`pairsim.tune.figures` states the rules)
into ``unified_figure5.png`` and ``unified_figure5.json`` beside the sweep's ``results.csv``, logs
them to the sweep's MLflow parent run, and prints the points and the verdicts and writes them
into ``--results`` (``unified_figure5.json`` and ``.md``, see ``results.py``). ``--set`` takes
the sweep file's keys as ``pairsim tune`` does (``data.path=DIR``, ``sweep.max_concurrent_trials=2``);
``--name`` of an existing sweep resumes it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
import reproduce
import results
from pairsim.tune import figures

SPACE = Path(__file__).resolve().parents[1] / "tune_spaces" / "unified_figure5.yaml"
FIGURE5 = figures.Figure(
    name="unified_figure5",
    title="Unified loss (Li et al.), Fig. 5 as a sweep: val RSUM against the margin m and the scale γ",
    symbols={"loss.base.margin": "m", "loss.base.gamma": "γ"},
    panels=(
        figures.Panel("loss.base.margin", (0.0, 0.1, 0.2, 0.3, 0.4), {"loss.base.gamma": 60}, (
            figures.Statement("best at m = 0.2", "best_at", 0.2),
            figures.Statement("m > 0 beats m = 0 (VLC)", "beats_at", 0.0))),
        figures.Panel("loss.base.gamma", (20, 40, 60, 80, 100), {"loss.base.margin": 0.2}, (
            figures.Statement("as γ grows, RSUM rises then falls", "peaks_inside"),)),
    ))


def tables(curves: list[list[figures.Point]], verdicts: list[figures.Verdict], metric: str) -> list[results.Table]:
    """The points panel by panel (– for a failed trial), then the statements with their verdicts."""
    points = results.Table(f"{FIGURE5.title}; each trial's best epoch", ["held", "swept", "value", metric],
                           ["", "", "g", ".2f"])
    for panel, curve in zip(FIGURE5.panels, curves):
        for point in curve:
            points.add(FIGURE5.where(panel), FIGURE5.symbol(panel.key), point.x, point.metric)
    judged = results.Table("The paper's statements", ["statement", "verdict", "detail"], ["", "", ""],
                           notes=[f"({figures.ONE_TRIAL_NOTE})"])
    for verdict in verdicts:
        judged.add(verdict.statement, verdict.outcome, verdict.detail)
    return [points, judged]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args, sweep, outcome = reproduce.research_sweep(SPACE, __doc__, argv)
    curves, verdicts = figures.report(FIGURE5, sweep, outcome)
    results.publish("unified_figure5", tables(curves, verdicts, sweep.metric), args.results,
                    time.perf_counter() - started)
    print(f"\nsweep {outcome.name}: {len(outcome.rows)} trials; {FIGURE5.name}.png and .json in {outcome.out_dir} "
          f"and on MLflow run {outcome.parent_run_id} ({outcome.tracking_uri})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
