"""What a person reads of a sweep: the console table, ``results.csv``, ``best.yaml`` (the best
trial's full run config, for ``pairsim train --config best.yaml``) and three plots — the metric
against each swept parameter, a parallel-coordinates plot, the metric per epoch of every
trial — written beside the Tune experiment and logged to the sweep's MLflow parent run."""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pairsim import tracking
from pairsim.config import yaml_value
from pairsim.data import shards
from pairsim.tune.space import POPULATION_SCHEDULERS, Sweep

PLOTS = ("metric_vs_params.png", "parallel_coordinates.png", "metric_vs_epoch.png")
STATUS_COLORS = {"finished": "tab:blue", "stopped early": "tab:orange", "failed": "tab:red"}
MLFLOW_STATUS = {"finished": "FINISHED", "stopped early": "KILLED", "failed": "FAILED"}  # of a trial's child run
STATUS_TAG = "pairsim.trial_status"
CLONE_TAG_PREFIX = "pairsim.pbt.clone."  # + the epoch a PBT trial took another's checkpoint at


@dataclass
class TrialRow:
    """One trial: its id, how it ended, epochs run, the sampled point, its best metric over the
    epochs, its MLflow child run and, for a failed trial, the error."""

    trial_id: str
    status: str
    epochs: int
    point: dict[str, Any]
    metric: float | None
    run_id: str | None = None
    error: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)  # (epoch, metric)
    clones: list[tuple[int, str]] = field(default_factory=list)  # PBT: (epoch, trial continued from)
    values: dict[str, float] = field(default_factory=dict)  # each objective at the last epoch (multi-objective)


def _short(key: str) -> str:
    return key.split(".", 1)[-1]


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _widths(sweep: Sweep) -> list[tuple[str, int]]:
    others = [(f"last {m.removeprefix('val/')}", max(len(m), 9)) for m, _ in sweep.objectives[1:]]
    return ([("trial", 8)] + [(_short(k), max(len(_short(k)), 9)) for k in sweep.keys]
            + [(sweep.metric.removeprefix("val/"), max(len(sweep.metric) - 4, 8)), *others, ("epochs", 6),
               ("status", 13)])


def table_header(sweep: Sweep) -> str:
    columns = _widths(sweep)
    header = "  ".join(name.ljust(width) for name, width in columns)
    return f"{header}\n{'-' * len(header)}"


def format_row(row: TrialRow, sweep: Sweep) -> str:
    cells = [row.trial_id[-8:]] + [_value(row.point.get(k, "")) for k in sweep.keys]
    cells += ["-" if row.metric is None else f"{row.metric:.2f}"]
    cells += [f"{row.values[m]:.2f}" if m in row.values else "-" for m, _ in sweep.objectives[1:]]
    cells += [str(row.epochs), row.status]
    line = "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _widths(sweep)))
    return line + (f"  {row.error.splitlines()[-1][:200]}" if row.error else "")


ERROR_TAIL_BYTES = 64 * 1024  # of a trial's error.txt: its last line is the exception


def trial_error(error_file: str | None) -> str:
    """The last line of a failed trial's error (the exception), or '': read from the end of
    Tune's ``error.txt``, at most :data:`ERROR_TAIL_BYTES` of it, and cut to 1,000 characters."""
    if not error_file or not Path(error_file).is_file():
        return ""
    with open(error_file, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - ERROR_TAIL_BYTES, 0))
        tail = f.read().decode("utf-8", errors="replace")
    lines = [line for line in tail.splitlines() if line.strip()]
    return lines[-1].strip()[:1000] if lines else ""


def trial_rows(grid, sweep: Sweep, children: list, sweep_name: str) -> list[TrialRow]:
    """A row per trial of Tune's ``ResultGrid``, matched to its MLflow child run."""
    runs = {run.data.tags.get(tracking.RUN_NAME_TAG): run for run in children}
    pick = max if sweep.mode == "max" else min
    rows = []
    for result in grid:
        trial_id = Path(result.path).name.removeprefix(f"{sweep_name}-")
        frame = result.metrics_dataframe
        curve = []
        if frame is not None and sweep.metric in frame and "epoch" in frame:
            curve = [(int(e), float(v)) for e, v in zip(frame["epoch"], frame[sweep.metric]) if not math.isnan(v)]
        epochs = max((e for e, _ in curve), default=0)
        if result.error is not None:
            status = "failed"
            error = str(result.error).strip().splitlines()[-1] if str(result.error).strip() else type(result.error).__name__
        else:
            status, error = ("finished" if epochs >= sweep.epochs else "stopped early"), ""
        values = {}
        if frame is not None and len(frame) and "epoch" in frame:
            last = frame.sort_values("epoch", kind="stable").iloc[-1]
            values = {m: float(last[m]) for m, _ in sweep.objectives if m in last and not math.isnan(last[m])}
        run = runs.get(f"{sweep_name}-{trial_id}")
        clones = sorted((int(tag.removeprefix(CLONE_TAG_PREFIX)), json.loads(value)["from"])
                        for tag, value in (run.data.tags.items() if run else ()) if tag.startswith(CLONE_TAG_PREFIX))
        rows.append(TrialRow(trial_id, status, epochs, sweep.point_of(result.config),
                             pick((v for _, v in curve), default=None), run and run.info.run_id, error, curve, clones,
                             values))
    return ranked(rows, sweep.mode)


def ranked(rows: list[TrialRow], mode: str) -> list[TrialRow]:
    """Best metric first (``mode`` max or min), trials without one last; ties by trial id."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(rows, key=lambda r: (r.metric is None, 0.0 if r.metric is None else sign * r.metric, r.trial_id))


def best_row(rows: list[TrialRow], sweep: Sweep) -> TrialRow | None:
    """The trial with the best metric at any epoch (its best checkpoint is what it would ship)."""
    scored = [r for r in rows if r.metric is not None]
    if not scored:
        return None
    return (max if sweep.mode == "max" else min)(scored, key=lambda r: r.metric)


def pareto_front(rows: list[TrialRow], objectives: list[tuple[str, str]]) -> list[TrialRow]:
    """The trials no other trial dominates (at least as good on every objective, better on one),
    by their last epoch's values; trials lacking a value take no part. Best first on the first
    objective."""
    signs = [1.0 if mode == "max" else -1.0 for _, mode in objectives]
    scored = [(r, [s * r.values[m] for s, (m, _) in zip(signs, objectives)]) for r in rows
              if all(m in r.values for m, _ in objectives)]
    front = [r for r, mine in scored
             if not any(all(o >= v for o, v in zip(other, mine)) and other != mine for _, other in scored)]
    return sorted(front, key=lambda r: -signs[0] * r.values[objectives[0][0]])


def best_yaml(row: TrialRow, sweep: Sweep, sweep_name: str, front: bool = False) -> str:
    """A trial's full run config, which ``pairsim train --config <file>`` reproduces: the best
    trial's (``best.yaml``, by its best metric) or, with ``front``, a Pareto-front trial's
    (``front/<trial>.yaml``, by each objective's last-epoch value)."""
    point = ", ".join(f"{k}={_value(v)}" for k, v in row.point.items())
    if front:
        what, file = "Pareto-front trial", f"front/{row.trial_id}.yaml"
        scores = ", ".join(f"{m} = {row.values[m]:.2f} ({mode}, last epoch)" for m, mode in sweep.objectives)
    else:
        what, file, scores = "Best trial", "best.yaml", f"{sweep.metric} = {row.metric:.2f} ({sweep.mode})"
    return (f"# {what} {row.trial_id} of sweep {sweep_name}: {scores} at {point}.\n"
            f"# Reproduce: pairsim train --config {file}\n" + sweep.trial_config(row.point).to_yaml())


def write_csv(rows: list[TrialRow], sweep: Sweep, path: Path) -> None:
    """One row per trial: its point, its best value of the metric, and (multi-objective) each
    objective's last-epoch value."""
    last = [m for m, _ in sweep.objectives] if sweep.multi_objective else []
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial_id", "status", "epochs", *sweep.keys, sweep.metric, *(f"last {m}" for m in last),
                         "mlflow_run_id", "error"])
        for row in rows:
            writer.writerow([row.trial_id, row.status, row.epochs, *(row.point.get(k) for k in sweep.keys),
                             "" if row.metric is None else row.metric, *(row.values.get(m, "") for m in last),
                             row.run_id or "", row.error])


def read_csv(path: Path, sweep: Sweep) -> list[TrialRow]:
    """The rows :func:`write_csv` wrote (their points, best metric, last-epoch objectives, run and
    error; not their curves), in the file's order: a finished sweep's results compared or
    re-ranked later without Ray."""
    last = [m for m, _ in sweep.objectives] if sweep.multi_objective else []
    with open(path, newline="") as f:
        return [TrialRow(r["trial_id"], r["status"], int(r["epochs"]),
                         {k: yaml_value(r[k]) for k in sweep.keys if r[k] != ""},
                         float(r[sweep.metric]) if r[sweep.metric] else None, r["mlflow_run_id"] or None, r["error"],
                         values={m: float(r[f"last {m}"]) for m in last if r[f"last {m}"]})
                for r in csv.DictReader(f)]


def write_front(rows: list[TrialRow], sweep: Sweep, out_dir: Path) -> list[Path]:
    """A multi-objective sweep's Pareto front: ``pareto.csv`` (its trials, best first on the first
    objective), ``pareto.png`` (every trial on the first two objectives, the front drawn) and
    ``front/<trial>.yaml`` per front point (its run config, as ``best.yaml`` is)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = pareto_front(rows, sweep.objectives)
    (out_dir / "front").mkdir(exist_ok=True)
    with open(out_dir / "pareto.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial_id", *sweep.keys, *(m for m, _ in sweep.objectives), "mlflow_run_id"])
        for row in front:
            writer.writerow([row.trial_id, *(row.point.get(k) for k in sweep.keys),
                             *(row.values[m] for m, _ in sweep.objectives), row.run_id or ""])
    written = [out_dir / "pareto.csv"]
    for row in front:
        path = out_dir / "front" / f"{row.trial_id}.yaml"
        path.write_text(best_yaml(row, sweep, out_dir.name, front=True))
        written.append(path)
    (x, x_mode), (y, y_mode) = sweep.objectives[:2]
    fig, ax = plt.subplots(figsize=(10.0, 4.8))
    scored = [r for r in rows if x in r.values and y in r.values]
    ax.scatter([r.values[x] for r in scored], [r.values[y] for r in scored], c="tab:grey", alpha=0.6, label="trial")
    steps = sorted(front, key=lambda r: r.values[x])
    ax.plot([r.values[x] for r in steps], [r.values[y] for r in steps], "o-", color="tab:red", label="Pareto front")
    for row in front:
        ax.annotate(row.trial_id[-5:], (row.values[x], row.values[y]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    points = [f"{row.trial_id[-5:]}  " + "  ".join(f"{_short(k)} {_value(v)}" for k, v in row.point.items())
              for row in front]  # beside the axes: the front's points, best first on the first objective
    ax.text(1.03, 1.0, "Pareto front:\n" + "\n".join(points), transform=ax.transAxes, va="top", fontsize=7,
            family="monospace")
    ax.set_xlabel(f"{x} ({x_mode} is better)")
    ax.set_ylabel(f"{y} ({y_mode} is better)")
    ax.set_title(f"{len(front)} of {len(scored)} trials on the Pareto front (last epoch)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "pareto.png", dpi=110)
    plt.close(fig)
    return [*written, out_dir / "pareto.png"]


def _log_scaled(values: list[float]) -> bool:
    """Positive values spanning more than a factor of 20 (learning rates, scales) read better on a log axis."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 20


def _axis_values(rows: list[TrialRow], key: str) -> tuple[list[float], list[str] | None]:
    """Numbers to plot a parameter at (log10 of wide positive ranges in parallel coordinates);
    categorical values (strings, flags, lists) become indices."""
    values = [row.point.get(key) for row in rows]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values], None
    labels = sorted({str(v) for v in values})
    return [float(labels.index(str(v))) for v in values], labels


def plot(rows: list[TrialRow], sweep: Sweep, out_dir: Path) -> list[Path]:
    """The three plots of :data:`PLOTS` (PNG) in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = sweep.metric.removeprefix("val/")
    scored = [r for r in rows if r.metric is not None]
    paths = [out_dir / name for name in PLOTS]

    keys = sweep.keys
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        xs, labels = _axis_values(scored, key)
        for status, color in STATUS_COLORS.items():
            picked = [(x, r.metric) for x, r in zip(xs, scored) if r.status == status]
            if picked:
                ax.scatter(*zip(*picked), c=color, label=status, alpha=0.8)
        if labels:
            ax.set_xticks(range(len(labels)), labels, rotation=30)
        elif any(space[key].kind == "loguniform" for space in sweep.spaces if key in space) or _log_scaled(xs):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"best val {metric}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"val {metric} against each swept parameter ({sweep.mode} is better)")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(2.2 * (len(keys) + 1) + 1, 4))
    columns = [_axis_values(scored, k) for k in keys] + [([r.metric for r in scored], None)]
    names = keys + [f"val {metric}"]
    spans = [(min(v), max(v)) if v else (0.0, 1.0) for v, _ in columns]
    logs = [labels is None and _log_scaled(v) for v, labels in columns]
    position = [[math.log10(x) for x in v] if log else v for (v, _), log in zip(columns, logs)]
    ranges = [(min(v), max(v)) if v else (0.0, 1.0) for v in position]
    if scored:
        lo, hi = spans[-1]
        cmap = plt.get_cmap("viridis")
        for i, row in enumerate(scored):
            ys = [(v[i] - a) / (b - a) if b > a else 0.5 for v, (a, b) in zip(position, ranges)]
            ax.plot(range(len(names)), ys, color=cmap((row.metric - lo) / (hi - lo) if hi > lo else 1.0),
                    alpha=0.85, linestyle="-" if row.status == "finished" else "--")
    for x, ((values, labels), (a, b)) in enumerate(zip(columns, spans)):
        ax.axvline(x, color="grey", lw=0.8)
        ax.annotate(_value(a) if not labels else labels[0], (x, -0.06), ha="center", fontsize=8)
        ax.annotate(_value(b) if not labels else labels[-1], (x, 1.03), ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks([])
    ax.set_ylim(-0.1, 1.1)
    ax.set_title(f"parallel coordinates: each trial a line, coloured by val {metric} (dashed: stopped early)")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    population = sweep.settings.scheduler in POPULATION_SCHEDULERS  # a colour per trial, its clones drawn
    colours = {row.trial_id: plt.get_cmap("tab10")(i % 10) for i, row in enumerate(rows)}
    for row in rows:
        cuts = [0, *(e for e, _ in row.clones), math.inf]  # a clone's own line stops where it took another's state
        pieces = [[(e, v) for e, v in row.curve if a < e <= b] for a, b in zip(cuts, cuts[1:])]
        for i, piece in enumerate(p for p in pieces if p):
            ax.plot(*zip(*piece), marker="o", alpha=0.8,
                    color=colours[row.trial_id] if population else STATUS_COLORS[row.status],
                    label=row.trial_id if population and i == 0 else None)
    curves = {row.trial_id: dict(row.curve) for row in rows}
    for row in rows:
        for epoch, donor in row.clones:  # the donor's value where it was cloned → the clone's next epoch
            after = [(e, v) for e, v in row.curve if e > epoch]
            if epoch in curves.get(donor, {}) and after:
                ax.plot([epoch, after[0][0]], [curves[donor][epoch], after[0][1]], ls="--", color="grey", lw=1)
                ax.plot(epoch, curves[donor][epoch], marker="*", ms=14, color=colours[row.trial_id], mec="black")
    if population:
        ax.plot([], [], ls="--", marker="*", color="grey", mec="black",
                label=f"continued from ({sweep.settings.scheduler.upper()} exploit)")
    else:
        for status, color in STATUS_COLORS.items():
            ax.plot([], [], color=color, label=status)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"val {metric}")
    ax.set_title(f"val {metric} per epoch of every trial" + (
        " (★: a trial took the checkpoint of the one it is drawn from)" if population else ""), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def log_inputs(tracking_uri: str, parent_run_id: str, sweep: Sweep) -> None:
    """The sweep file and its resolved base run config, as artifacts of the parent run, and the
    base's train and val splits as its dataset inputs (:func:`pairsim.tracking.log_datasets`)."""
    tracking.log_datasets(tracking_uri, parent_run_id, shards.RunData.read(sweep.base.data), test=False)
    with tracking.RunLogger(tracking_uri, parent_run_id) as run, tempfile.TemporaryDirectory() as tmp:
        run.log_artifact(sweep.source, "sweep")
        base = Path(tmp) / "base_config.yaml"
        base.write_text(sweep.base.to_yaml())
        run.log_artifact(base, "sweep")


def write(rows: list[TrialRow], best: TrialRow | None, sweep: Sweep, out_dir: Path, tracking_uri: str,
          parent_run_id: str, children: list) -> None:
    """``results.csv``, ``best.yaml`` and the plots into ``out_dir`` and the parent run; the
    best metric and trial counts as the parent's metrics; each child run's final status."""
    children = {run.info.run_id: run for run in children}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, sweep, out_dir / "results.csv")
    written = [out_dir / "results.csv", *plot(rows, sweep, out_dir)]
    front = write_front(rows, sweep, out_dir) if sweep.multi_objective else []
    if best is not None:
        (out_dir / "best.yaml").write_text(best_yaml(best, sweep, out_dir.name))
        written.append(out_dir / "best.yaml")
    with tracking.RunLogger(tracking_uri, parent_run_id) as run:
        for path in written:
            run.log_artifact(path)
        for path in front:
            run.log_artifact(path, "front" if path.parent == out_dir / "front" else None)
        counts = {s: sum(r.status == s for r in rows) for s in STATUS_COLORS}
        run.log_metrics({f"trials/{s.replace(' ', '_')}": n for s, n in counts.items()}
                        | {"trials/epochs": sum(r.epochs for r in rows)}
                        | ({f"best/{sweep.metric.removeprefix('val/')}": best.metric} if best else {}), 0)
        if best is not None:
            run.set_tags({"pairsim.best_trial": best.trial_id, "pairsim.best_run_id": best.run_id or ""})
    for row, child in ((row, children.get(row.run_id)) for row in rows):
        if child is not None and child.info.status != MLFLOW_STATUS[row.status]:  # e.g. killed while the driver was down
            tracking.set_run_status(tracking_uri, row.run_id, MLFLOW_STATUS[row.status],
                                    {STATUS_TAG: row.status.replace(" ", "_")})
