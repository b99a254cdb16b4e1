"""What a person reads of a sweep: the console table, ``results.csv``, ``best.yaml`` (the best
trial's full run config, for ``pairsim train --config best.yaml``) and three plots — the metric
against each swept parameter, a parallel-coordinates plot, the metric per epoch of every
trial — written beside the Tune experiment and logged to the sweep's MLflow parent run."""

from __future__ import annotations

import csv
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pairsim import tracking
from pairsim.tune.space import Sweep

PLOTS = ("metric_vs_params.png", "parallel_coordinates.png", "metric_vs_epoch.png")
STATUS_COLORS = {"finished": "tab:blue", "stopped early": "tab:orange", "failed": "tab:red"}
MLFLOW_STATUS = {"finished": "FINISHED", "stopped early": "KILLED", "failed": "FAILED"}  # of a trial's child run
STATUS_TAG = "pairsim.trial_status"


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


def _short(key: str) -> str:
    return key.split(".", 1)[-1]


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _widths(sweep: Sweep) -> list[tuple[str, int]]:
    return ([("trial", 8)] + [(_short(k), max(len(_short(k)), 9)) for k in sweep.keys]
            + [(sweep.metric.removeprefix("val/"), max(len(sweep.metric) - 4, 8)), ("epochs", 6), ("status", 13)])


def table_header(sweep: Sweep) -> str:
    columns = _widths(sweep)
    header = "  ".join(name.ljust(width) for name, width in columns)
    return f"{header}\n{'-' * len(header)}"


def format_row(row: TrialRow, sweep: Sweep) -> str:
    cells = [row.trial_id[-8:]] + [_value(row.point.get(k, "")) for k in sweep.keys]
    cells += ["-" if row.metric is None else f"{row.metric:.2f}", str(row.epochs), row.status]
    line = "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _widths(sweep)))
    return line + (f"  {row.error.splitlines()[-1][:200]}" if row.error else "")


def trial_error(error_file: str | None) -> str:
    """The last line of a failed trial's error (the exception), or ''."""
    if not error_file or not Path(error_file).is_file():
        return ""
    lines = [line for line in Path(error_file).read_text().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def trial_rows(grid, sweep: Sweep, children: list, sweep_name: str) -> list[TrialRow]:
    """A row per trial of Tune's ``ResultGrid``, matched to its MLflow child run."""
    runs = {run.data.tags.get(tracking.RUN_NAME_TAG): run.info.run_id for run in children}
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
        rows.append(TrialRow(trial_id, status, epochs, sweep.point_of(result.config),
                             pick((v for _, v in curve), default=None), runs.get(f"{sweep_name}-{trial_id}"),
                             error, curve))
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


def best_yaml(best: TrialRow, sweep: Sweep, sweep_name: str) -> str:
    """The best trial's full run config, which ``pairsim train --config best.yaml`` reproduces."""
    point = ", ".join(f"{k}={_value(v)}" for k, v in best.point.items())
    return (f"# Best trial {best.trial_id} of sweep {sweep_name}: {sweep.metric} = {best.metric:.2f} "
            f"({sweep.mode}) at {point}.\n# Reproduce: pairsim train --config best.yaml\n"
            + sweep.trial_config(best.point).to_yaml())


def write_csv(rows: list[TrialRow], sweep: Sweep, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial_id", "status", "epochs", *sweep.keys, sweep.metric, "mlflow_run_id", "error"])
        for row in rows:
            writer.writerow([row.trial_id, row.status, row.epochs, *(row.point.get(k) for k in sweep.keys),
                             "" if row.metric is None else row.metric, row.run_id or "", row.error])


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
    for row in rows:
        if row.curve:
            epochs, values = zip(*row.curve)
            ax.plot(epochs, values, marker="o", color=STATUS_COLORS[row.status], alpha=0.8)
    for status, color in STATUS_COLORS.items():
        ax.plot([], [], color=color, label=status)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"val {metric}")
    ax.set_title(f"val {metric} per epoch of every trial")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def log_inputs(tracking_uri: str, parent_run_id: str, sweep: Sweep) -> None:
    """The sweep file and its resolved base run config, as artifacts of the parent run, and the
    base's train and val splits as its dataset inputs (:func:`pairsim.tracking.log_datasets`)."""
    tracking.log_datasets(tracking_uri, parent_run_id, sweep.base.data, test=False)
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
    if best is not None:
        (out_dir / "best.yaml").write_text(best_yaml(best, sweep, out_dir.name))
        written.append(out_dir / "best.yaml")
    with tracking.RunLogger(tracking_uri, parent_run_id) as run:
        for path in written:
            run.log_artifact(path)
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
