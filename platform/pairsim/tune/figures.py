"""A paper's parameter-analysis figure redrawn from a sweep's trials, with a verdict on each of
the paper's statements about it.

A :class:`Figure` has panels; a :class:`Panel` is the sweep's metric against one swept key at
the values the paper plots, the other swept keys held (a one-dimensional slice of the trials),
and the paper's statements about that curve. Each :class:`Statement` is judged by an explicit
rule on the measured curve ("better" by the metric's mode):

- ``best_at`` v: the best point is at v, and only there (a tie is no best);
- ``beats_at`` v: the best point above v is better than the point at v (the detail also
  counts how many above v are);
- ``peaks_inside``: the best points are inside the range, both ends worse (it rises, then falls).

A statement holds or does not; it is "not measured" when a point of its panel has no metric
(its trial failed or is missing). A point's metric is its trial's best over the epochs (the
sweep's ranking; the mean if several trials ran it). With one trial per point a verdict says
what those trials measured, not whether a difference exceeds the noise between seeds.

:func:`report` writes the picture (the curves, each statement and its verdict under them) and a
JSON of the points and verdicts beside the sweep's results and logs them to its MLflow parent run.
"""

from __future__ import annotations

import json
import math
import operator
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pairsim import tracking
from pairsim.tune.results import TrialRow

if TYPE_CHECKING:
    from pairsim.tune.space import Sweep
    from pairsim.tune.sweep import SweepResult

Rule = Literal["best_at", "beats_at", "peaks_inside"]
Outcome = Literal["holds", "does not hold", "not measured"]
COLORS = {"holds": "tab:green", "does not hold": "tab:red", "not measured": "tab:gray"}
ONE_TRIAL_NOTE = ("one trial (one seed) per point: a verdict is what these trials measured, "
                  "not a difference beyond the noise between seeds")


@dataclass(frozen=True)
class Statement:
    """A paper's statement about one panel's curve, judged by ``rule`` (at x = ``at``)."""

    words: str
    rule: Rule
    at: float | None = None

    def __post_init__(self) -> None:
        if (self.at is None) != (self.rule == "peaks_inside"):
            raise ValueError(f"{self.rule}: {'takes no' if self.rule == 'peaks_inside' else 'needs a'} value at")


@dataclass(frozen=True)
class Panel:
    """The metric against ``key`` at ``values`` (ascending), the keys of ``fixed`` held."""

    key: str
    values: tuple[float, ...]
    fixed: dict[str, Any]
    statements: tuple[Statement, ...]

    def __post_init__(self) -> None:
        if len(self.values) < 2 or list(self.values) != sorted(set(self.values)):
            raise ValueError(f"{self.key}: values must ascend, at least two of them, got {self.values}")
        for statement in self.statements:
            if statement.at is not None and statement.at not in self.values:
                raise ValueError(f"{statement.words!r}: {self.key} = {statement.at} is not a value of the panel")
            if statement.rule == "beats_at" and statement.at == self.values[-1]:
                raise ValueError(f"{statement.words!r}: beats_at needs values above {statement.at}")
            if statement.rule == "peaks_inside" and len(self.values) < 3:
                raise ValueError(f"{statement.words!r}: peaks_inside needs at least 3 values")


@dataclass(frozen=True)
class Figure:
    """``name`` names its files (``<name>.png``, ``<name>.json``); ``symbols`` the swept keys in
    the picture (``{"loss.base.margin": "m"}``)."""

    name: str
    title: str
    symbols: dict[str, str]
    panels: tuple[Panel, ...]

    def symbol(self, key: str) -> str:
        return self.symbols.get(key, key)

    def where(self, panel: Panel) -> str:
        """``γ = 60``: what the panel holds."""
        return ", ".join(f"{self.symbol(k)} = {_num(v)}" for k, v in panel.fixed.items())


@dataclass(frozen=True)
class Point:
    """One point of a panel: x, its metric (None: not measured) and the trials that ran it."""

    x: float
    metric: float | None
    trials: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    statement: str
    outcome: Outcome
    detail: str

    def line(self) -> str:
        return f"{self.statement}: {self.outcome} ({self.detail})"


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def _same(a: Any, b: Any) -> bool:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) if numbers else a == b


def curve(panel: Panel, rows: list[TrialRow]) -> list[Point]:
    """The panel's points from the sweep's trials."""
    points = []
    for x in panel.values:
        at = {panel.key: x} | panel.fixed
        trials = [r for r in rows if all(k in r.point and _same(r.point[k], v) for k, v in at.items())]
        scored = [r.metric for r in trials if r.metric is not None]
        points.append(Point(x, statistics.fmean(scored) if scored else None, tuple(r.trial_id for r in trials)))
    return points


def judge(statement: Statement, points: list[Point], symbol: str, mode: str) -> Verdict:
    """The verdict on ``statement`` from the panel's ``points`` (see the module's rules)."""
    missing = [p.x for p in points if p.metric is None]
    if missing:
        return Verdict(statement.words, "not measured", f"no metric at {symbol} = {', '.join(map(_num, missing))}")
    better = operator.gt if mode == "max" else operator.lt
    best = (max if mode == "max" else min)(p.metric for p in points)
    winners = [p.x for p in points if p.metric == best]
    at_best = f"best {best:.2f} at {symbol} = {', '.join(map(_num, winners))}"
    if statement.rule == "best_at":
        holds = winners == [statement.at]
        detail = at_best
    elif statement.rule == "beats_at":
        base = next(p for p in points if p.x == statement.at)
        above = [p for p in points if p.x > statement.at]
        top = (max if mode == "max" else min)(above, key=lambda p: p.metric)
        holds = better(top.metric, base.metric)
        beating = sum(better(p.metric, base.metric) for p in above)
        detail = (f"best above {_num(statement.at)}: {top.metric:.2f} at {symbol} = {_num(top.x)}, against "
                  f"{base.metric:.2f} at {_num(statement.at)}; {beating} of {len(above)} above it beat it")
    else:
        ends = (points[0].x, points[-1].x)
        holds = not set(winners) & set(ends)
        detail = f"{at_best}; ends {points[0].metric:.2f} and {points[-1].metric:.2f}"
    return Verdict(statement.words, "holds" if holds else "does not hold", detail)


def evaluate(figure: Figure, rows: list[TrialRow], mode: str) -> tuple[list[list[Point]], list[Verdict]]:
    """Each panel's points and every statement's verdict."""
    curves = [curve(panel, rows) for panel in figure.panels]
    verdicts = [judge(s, points, figure.symbol(panel.key), mode)
                for panel, points in zip(figure.panels, curves) for s in panel.statements]
    return curves, verdicts


def draw(figure: Figure, curves: list[list[Point]], verdicts: list[Verdict], metric: str, path: Path) -> Path:
    """The panels side by side, the statements and their verdicts below them (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = metric.replace("/", " ")
    lines = len(verdicts) + 1
    fig = plt.figure(figsize=(5.2 * len(figure.panels), 4.0 + 0.32 * lines))
    grid = fig.add_gridspec(2, len(figure.panels), height_ratios=[4.0, 0.32 * lines + 0.2])
    for i, (panel, points) in enumerate(zip(figure.panels, curves)):
        ax = fig.add_subplot(grid[0, i])
        ax.plot([p.x for p in points], [math.nan if p.metric is None else p.metric for p in points],
                marker="o", color="tab:blue")  # a point not measured: a gap
        for p in points:
            if p.metric is None:
                ax.axvline(p.x, color="tab:gray", linestyle=":")
            else:
                ax.annotate(f"{p.metric:.1f}", (p.x, p.metric), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=8)
        ax.set_xticks(panel.values, [_num(v) for v in panel.values])
        ax.set_xlabel(figure.symbol(panel.key))
        ax.set_ylabel(f"best {label}")
        ax.set_title(f"{label} against {figure.symbol(panel.key)} at {figure.where(panel)}", fontsize=10)
        ax.grid(alpha=0.3)
    text = fig.add_subplot(grid[1, :])
    text.axis("off")
    for j, verdict in enumerate(verdicts):
        text.text(0.0, 1 - j / lines, f"{verdict.statement}: {verdict.outcome.upper()}  ({verdict.detail})",
                  color=COLORS[verdict.outcome], fontsize=9, va="top", transform=text.transAxes)
    text.text(0.0, 1 - len(verdicts) / lines, ONE_TRIAL_NOTE, color="black", fontsize=8, style="italic", va="top",
              transform=text.transAxes)
    fig.suptitle(figure.title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(figure: Figure, sweep: Sweep, outcome: SweepResult) -> tuple[list[list[Point]], list[Verdict]]:
    """Judge the figure on the sweep's trials (:func:`evaluate`); ``<name>.png`` and
    ``<name>.json`` into the sweep's directory and onto its parent run, a tag per verdict
    (``pairsim.<name>.<i>``)."""
    curves, verdicts = evaluate(figure, outcome.rows, sweep.mode)
    png = draw(figure, curves, verdicts, sweep.metric, outcome.out_dir / f"{figure.name}.png")
    data = {"figure": figure.name, "title": figure.title, "metric": sweep.metric, "mode": sweep.mode,
            "note": ONE_TRIAL_NOTE,
            "panels": [{"key": panel.key, "fixed": panel.fixed, "points": [asdict(p) for p in points]}
                       for panel, points in zip(figure.panels, curves)],
            "verdicts": [asdict(v) for v in verdicts]}
    path = outcome.out_dir / f"{figure.name}.json"
    path.write_text(json.dumps(data, indent=2))
    with tracking.RunLogger(outcome.tracking_uri, outcome.parent_run_id) as run:
        run.log_artifact(png)
        run.log_artifact(path)
        run.set_tags({f"pairsim.{figure.name}.{i}": v.line() for i, v in enumerate(verdicts)})
    return curves, verdicts
