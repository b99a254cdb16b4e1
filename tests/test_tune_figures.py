"""A paper's figure from a sweep's trials (``pairsim.tune.figures``) and the Unified paper's
Figure 5 (``benchmarks/unified_figure5.py``): the verdict rules on made-up trials, the picture and
the JSON on the sweep's MLflow parent run. No Ray instance, no training."""

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from pairsim import tracking
from pairsim.tune import figures
from pairsim.tune import results
from pairsim.tune.results import TrialRow
from pairsim.tune.space import load_sweep

REPO = Path(__file__).parents[1]
SWEEP = load_sweep(REPO / "tune_spaces" / "unified_figure5.yaml")


@pytest.fixture
def figure5_script(monkeypatch):
    """``benchmarks/unified_figure5.py`` (its ``checkout_path`` import changes sys.path and PYTHONPATH: undone after)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    spec = importlib.util.spec_from_file_location("unified_figure5", REPO / "benchmarks" / "unified_figure5.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def figure5(figure5_script) -> figures.Figure:
    return figure5_script.FIGURE5


def trials(metric) -> list[TrialRow]:
    """A finished trial at each point of the Figure 5 sweep, its metric ``metric(m, γ)`` (None: failed)."""
    rows = []
    for i, point in enumerate(SWEEP.grid_points()):
        value = metric(point["loss.base.margin"], point["loss.base.gamma"])
        rows.append(TrialRow(f"{i:05d}", "failed" if value is None else "finished", 6, point, value))
    return rows


def outcomes(figure: figures.Figure, rows: list[TrialRow], mode: str = "max") -> list[str]:
    return [v.outcome for v in figures.evaluate(figure, rows, mode)[1]]


def test_figure5_panels_are_the_points_of_its_sweep(figure5):
    points = [{panel.key: x} | panel.fixed for panel in figure5.panels for x in panel.values]
    assert len(points) == 10 and all(p in SWEEP.grid_points() for p in points)
    assert all(p in points for p in SWEEP.grid_points())
    assert [s.words for p in figure5.panels for s in p.statements] == [
        "best at m = 0.2", "m > 0 beats m = 0 (VLC)", "as γ grows, RSUM rises then falls"]


def test_the_papers_shape_holds(figure5):
    rows = trials(lambda m, g: 296 - 500 * (m - 0.2) ** 2 + 20 * m - 0.01 * (g - 60) ** 2)
    curves, verdicts = figures.evaluate(figure5, rows, "max")
    assert [p.x for p in curves[0]] == [0.0, 0.1, 0.2, 0.3, 0.4] and [p.x for p in curves[1]] == [20, 40, 60, 80, 100]
    assert curves[0][2].metric == curves[1][2].metric == 300  # (0.2, 60): one trial on both curves
    assert [v.outcome for v in verdicts] == ["holds"] * 3
    assert verdicts[1].detail.endswith("4 of 4 above it beat it")


def test_monotone_curves_do_not_hold(figure5):
    verdicts = figures.evaluate(figure5, trials(lambda m, g: 100 + 10 * m + g / 10), "max")[1]
    assert [v.outcome for v in verdicts] == ["does not hold", "holds", "does not hold"]
    assert "best 110.00 at m = 0.4" in verdicts[0].detail
    assert "best 112.00 at γ = 100" in verdicts[2].detail
    falling = figures.evaluate(figure5, trials(lambda m, g: 100 - 10 * m - g / 10), "max")[1]
    assert [v.outcome for v in falling] == ["does not hold", "does not hold", "does not hold"]
    assert falling[1].detail.endswith("0 of 4 above it beat it")


def test_one_margin_above_zero_is_enough_for_the_second_statement(figure5):
    rows = trials(lambda m, g: {0.0: 50, 0.1: 40, 0.2: 60, 0.3: 45, 0.4: 30}[m] - abs(g - 60) / 10)
    verdicts = figures.evaluate(figure5, rows, "max")[1]
    assert [v.outcome for v in verdicts] == ["holds", "holds", "holds"]
    assert verdicts[1].detail == ("best above 0: 60.00 at m = 0.2, against 50.00 at 0; "
                                  "1 of 4 above it beat it")


def test_ties_are_no_best_and_no_peak(figure5):
    rows = trials(lambda m, g: 60 if (m, g) in ((0.2, 60), (0.3, 60), (0.2, 100)) else 50)
    assert outcomes(figure5, rows) == ["does not hold", "holds", "does not hold"]


def test_a_failed_trial_leaves_its_panel_not_measured(figure5):
    rows = trials(lambda m, g: None if g == 80 else 300 - 500 * (m - 0.2) ** 2 - 0.01 * (g - 60) ** 2)
    verdicts = figures.evaluate(figure5, rows, "max")[1]
    assert [v.outcome for v in verdicts] == ["holds", "holds", "not measured"]
    assert verdicts[2].detail == "no metric at γ = 80"
    missing = [r for r in rows if r.point != {"loss.base.margin": 0.0, "loss.base.gamma": 60}]  # a trial never run
    assert outcomes(figure5, missing)[:2] == ["not measured", "not measured"]


def test_a_metric_ranked_min_judges_the_lowest_best(figure5):
    rows = trials(lambda m, g: 1 + 100 * (m - 0.2) ** 2 + m + (g - 60) ** 2 / 100)  # a rank: lower is better
    assert outcomes(figure5, rows, "min") == ["holds", "holds", "holds"]
    assert outcomes(figure5, rows, "max") == ["does not hold", "holds", "does not hold"]


@pytest.mark.parametrize("make, message", [
    (lambda: figures.Statement("x", "best_at"), "best_at: needs a value at"),
    (lambda: figures.Statement("x", "peaks_inside", 0.2), "peaks_inside: takes no value at"),
    (lambda: figures.Panel("loss.base.margin", (0.2, 0.1), {}, ()), "values must ascend"),
    (lambda: figures.Panel("loss.base.margin", (0.1, 0.2), {}, (figures.Statement("x", "best_at", 0.3),)),
     "loss.base.margin = 0.3 is not a value of the panel"),
    (lambda: figures.Panel("loss.base.margin", (0.1, 0.2), {}, (figures.Statement("x", "beats_at", 0.2),)),
     "beats_at needs values above 0.2"),
    (lambda: figures.Panel("loss.base.margin", (0.1, 0.2), {}, (figures.Statement("x", "peaks_inside"),)),
     "peaks_inside needs at least 3 values"),
], ids=["best-at-without-value", "peaks-inside-with-value", "unordered", "value-off-panel", "nothing-above",
        "two-values"])
def test_malformed_statements_and_panels_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_report_writes_and_logs_the_picture_and_the_verdicts(figure5_script, tmp_path):
    from PIL import Image

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = tracking.create_run(uri, "figure5", "fig5", {})
    rows = trials(lambda m, g: None if (m, g) == (0.4, 60) else 100 + 10 * m + g / 10)
    outcome = SimpleNamespace(rows=rows, out_dir=tmp_path, tracking_uri=uri, parent_run_id=parent)
    curves, verdicts = figures.report(figure5_script.FIGURE5, SWEEP, outcome)
    with Image.open(tmp_path / "unified_figure5.png") as image:
        assert image.format == "PNG" and image.width > 800
    data = json.loads((tmp_path / "unified_figure5.json").read_text())
    assert (data["metric"], data["mode"]) == ("val/rsum", "max") and "one seed" in data["note"]
    assert data["panels"][1]["fixed"] == {"loss.base.margin": 0.2}
    assert [p["metric"] for p in data["panels"][0]["points"]] == [106.0, 107.0, 108.0, 109.0, None]
    assert [v["outcome"] for v in data["verdicts"]] == ["not measured", "not measured", "does not hold"]
    client = MlflowClient(uri)
    assert {a.path for a in client.list_artifacts(parent)} == {"unified_figure5.png", "unified_figure5.json"}
    tags = client.get_run(parent).data.tags
    assert tags["pairsim.unified_figure5.2"] == verdicts[2].line()
    assert tags["pairsim.unified_figure5.2"].startswith("as γ grows, RSUM rises then falls: does not hold (best ")
    points, statements = figure5_script.tables(curves, verdicts, SWEEP.metric)
    assert points.rows[0] == ["γ = 60", "m", 0.0, 106.0] and points.rows[4] == ["γ = 60", "m", 0.4, None]
    assert points.rows[5] == ["m = 0.2", "γ", 20, 104.0] and points.columns[-1] == "val/rsum"
    assert statements.rows == [[v.statement, v.outcome, v.detail] for v in verdicts]


@pytest.mark.parametrize("mode", ["max", "min"])
def test_trials_are_ranked_best_first_with_unscored_ones_last(mode):
    rows = trials(lambda m, gamma: None if gamma == 100 else 100 * m + gamma)
    order = results.ranked(list(reversed(rows)), mode)
    values = [r.metric for r in order]
    scored = [v for v in values if v is not None]
    assert scored == sorted(scored, reverse=mode == "max") and values[len(scored):] == [None]
    tied = trials(lambda m, gamma: 1.0)
    assert [r.trial_id for r in results.ranked(list(reversed(tied)), mode)] == [r.trial_id for r in tied]


def test_the_per_epoch_plot_has_whole_epochs_on_its_axis(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    rows = [TrialRow(f"{i}", "finished", 3, point, 1.0, curve=[(1, 1.0 + i), (2, 2.0 + i), (3, 2.5 + i)])
            for i, point in enumerate(SWEEP.grid_points())]
    results.plot(rows, SWEEP, tmp_path)
    ticks = [t for t in saved[-1].axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3]
