"""The commands that train: ``demo``, ``train``, ``tune`` and ``extract-teacher``; the shipped
configs they start from; what they print of a finished run or sweep."""

from __future__ import annotations

import argparse
from pathlib import Path

from pairsim import log, storage
from pairsim.config import ConfigError, RunConfig, load_config

logger = log.get_logger("cli")
DEMO_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"
OBJECTIVES = Path(__file__).parents[1] / "configs" / "objectives"
DEMO_SWEEP = Path(__file__).parents[1] / "configs" / "demo_sweep.yaml"
DEMO_SWEEP_SHAPES = {"num_train": 3000, "num_val": 500, "num_test": 0}  # scenes of the demo sweep's dataset


def shipped_objectives() -> list[str]:
    """The names of the shipped objective presets (``configs/objectives/*.yaml``)."""
    return sorted(p.stem for p in OBJECTIVES.glob("*.yaml"))


def objective_config(name: str) -> Path:
    """The file of the shipped objective preset ``name`` (``configs/objectives/<name>.yaml``), to
    layer on a run config; :class:`ConfigError` naming the shipped ones when there is none."""
    path = OBJECTIVES / f"{name}.yaml"
    if not path.is_file():
        known = shipped_objectives()
        raise ConfigError(f"--objective: unknown objective {name!r} (shipped: {', '.join(known)})")
    return path


def print_run(run_id: str, tracking_uri: str) -> None:
    """Where to look at the MLflow run ``run_id``: its store (credentials masked), the ``mlflow ui``
    command for a sqlite store, and the run's page."""
    from pairsim.tracking import ui_url

    print(f"\nMLflow run {run_id} in {storage.masked(tracking_uri)}")
    if tracking_uri.startswith("sqlite:///"):
        print(f"look at it with:  mlflow ui --host 127.0.0.1 --backend-store-uri {storage.masked(tracking_uri)}")
    print(f"then open:  {storage.masked(ui_url(tracking_uri, run_id))}")


def train_and_report(cfg: RunConfig, resume: bool = False) -> None:
    """``pairsim train``: one run of ``cfg``, then its val (and test) retrieval and where its MLflow run is."""
    from pairsim.eval.report import format_report  # heavy imports only once the config is known to be good
    from pairsim.train.driver import fit

    result = fit(cfg, resume=resume)
    val = {k.removeprefix("val/"): v for k, v in result.metrics.items() if k.startswith("val/")}
    print(f"\nval retrieval after {result.metrics.get('epoch')} epochs (run {result.run_name}):")
    print(format_report(val, cfg.eval.ks))
    if result.test_metrics:
        print(f"\n{cfg.data.test_split} retrieval of the best checkpoint (by val {cfg.eval.select_metric}):")
        print(format_report(result.test_metrics, cfg.eval.ks))
    print_run(result.mlflow_run_id, result.tracking_uri)
    print(f"best checkpoint: {result.best_checkpoint_path}\nlatest checkpoint: {result.checkpoint_path}")


def sweep_and_report(space: Path, overrides: list[str], name: str | None = None, resume: str | None = None) -> None:
    """``pairsim tune``: the sweep of the file ``space``, then its trials' table, best trial, Pareto front
    and where its MLflow run is; :class:`SweepFailed` when no trial reported a metric."""
    from pairsim.tune.space import load_sweep

    if resume and name and resume != name:
        raise ConfigError(f"--resume {resume} and --name {name}: give one sweep name")
    sweep = load_sweep(space, overrides)  # every error in the file, before Ray starts
    from pairsim.tune import results
    from pairsim.tune.sweep import run_sweep

    outcome = run_sweep(sweep, resume or name, resume=resume is not None)
    print(f"\nsweep {outcome.name}: {len(outcome.rows)} trials, ranked by {sweep.metric} ({sweep.mode})")
    print(results.table_header(sweep))
    for row in outcome.rows:
        print(results.format_row(row, sweep))
    if outcome.best:
        print(f"\nbest: trial {outcome.best.trial_id}, {sweep.metric} = {outcome.best.metric:.2f}; its config: "
              f"{outcome.out_dir / 'best.yaml'}\nreproduce it with:  pairsim train --config {outcome.out_dir / 'best.yaml'}")
    if sweep.multi_objective:
        front = results.pareto_front(outcome.rows, sweep.objectives)
        print(f"\nPareto front over {', '.join(m for m, _ in sweep.objectives)} (last epoch): "
              + "; ".join(f"{r.trial_id} (" + ", ".join(f"{r.values[m]:.2f}" for m, _ in sweep.objectives) + ")"
                          for r in front)
              + f"\nin {outcome.out_dir / 'pareto.csv'}, each point's config in {outcome.out_dir / 'front'}/")
    print(f"results.csv and plots in {outcome.out_dir}; resume or extend with:  pairsim tune --space {space} "
          f"--name {outcome.name}")
    print_run(outcome.parent_run_id, outcome.tracking_uri)
    if outcome.best is None:
        raise SweepFailed("no trial reported a val metric: every trial failed (errors above and in results.csv)")


class SweepFailed(RuntimeError):
    """A sweep in which no trial reported a metric."""


def ensure_demo_data(path: Path, **sizes: int) -> None:
    from pairsim.data import synth

    logger.info("the shapes dataset in %s (generated if absent)", path)
    synth.ensure(path, **sizes)


def demo(args: argparse.Namespace) -> None:
    """``pairsim demo``: the shapes dataset (generated if absent), then a run of the demo config or, with
    ``--sweep``, the demo sweep."""
    if args.sweep:
        if args.objective:
            raise ConfigError("--objective: the demo sweep searches the Unified loss; drop --objective or --sweep")
        from pairsim.tune.space import load_sweep

        ensure_demo_data(load_sweep(DEMO_SWEEP, args.overrides).base.data.path, **DEMO_SWEEP_SHAPES)
        sweep_and_report(DEMO_SWEEP, args.overrides)
        return
    cfg = load_config([DEMO_CONFIG] + ([objective_config(args.objective)] if args.objective else []), args.overrides)
    ensure_demo_data(cfg.data.path)
    train_and_report(cfg)


def extract_teacher(args: argparse.Namespace) -> None:
    from pairsim import build
    from pairsim.cluster import init_ray
    from pairsim.teachers import store

    cfg = load_config(args.config, args.overrides)
    build.check_teachers(cfg)
    store.claim_output(args.out)
    init_ray(cfg)
    out = store.extract(cfg, build.build_teachers(cfg), args.out, args.splits or [cfg.data.train_split],
                        args.batch_size, args.concurrency)
    print(f"teacher features in {out}; train from them with --set loss.cusa.teacher_features={out}")
