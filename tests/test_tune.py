"""Sweeps end to end on a real Ray instance and real MLflow: ASHA stopping a weak trial, a trial
whose numerics blow up recorded as failed while the others go on, the parent run with one child
per trial and its plots, ``best.yaml`` reproducing the best trial, and a sweep driver killed with
SIGKILL then resumed into the same parent run without re-running or duplicating a trial."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

import toy_loss  # noqa: F401  (registers cos_hinge_unstable here; workers import it from the pickled config)
from pairsim import tracking
from pairsim.config import load_config
from pairsim.tune import results
from pairsim.tune.space import load_sweep

pytestmark = pytest.mark.slow


def write_sweep(path: Path, data: Path, storage: Path, tracking_uri: str, space: dict, sweep: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "base": {"config": ["pairsim:demo.yaml"],
                 "data": {"path": str(data), "test_split": None},
                 "train": {"num_workers": 1, "micro_batch_size": 16, "epochs": 2, "log_every_n_steps": 4},
                 "optim": {"warmup_steps": 2}, "eval": {"batch_size": 64},
                 "ray": {"data_cpus": 1, "storage_path": str(storage)},
                 "tracking": {"tracking_uri": tracking_uri, "experiment": path.stem}},
        "space": space, "sweep": sweep}))
    return path


@pytest.fixture(scope="module")
def asha_sweep(ray_instance, tiny_dataset, tmp_path_factory, mlflow_server):
    """Three warm trials (each trained in its reused Tune trial actor) against a real `mlflow
    server`, a union of two grids: a hinge margin of 0.2 with a learning rate of 2e-3 or 1e-7
    (learns nothing: ASHA stops it after epoch 1), and a margin of 1.5 (non-finite: fails) at 2e-3."""
    from pairsim.tune.sweep import run_sweep

    root = tmp_path_factory.mktemp("asha")
    path = write_sweep(root / "asha.yaml", tiny_dataset, root / "ray", mlflow_server,
                       [{"loss.base.cos_margin": {"grid": [0.2]}, "optim.lr": {"grid": [2.0e-3, 1.0e-7]}},
                        {"loss.base.cos_margin": {"grid": [1.5]}, "optim.lr": {"grid": [2.0e-3]}}],
                       {"search": "grid", "num_samples": 1, "scheduler": "asha",
                        "asha": {"grace_period": 1, "reduction_factor": 2}, "max_concurrent_trials": 1, "warm": True})
    sweep = load_sweep(path, ["loss.base=cos_hinge_unstable"])
    return sweep, run_sweep(sweep, "asha")


def test_asha_stops_the_weak_trial_and_the_failing_ones_do_not_stop_the_sweep(asha_sweep):
    sweep, outcome = asha_sweep
    by_point = {(r.point["loss.base.cos_margin"], r.point["optim.lr"]): r for r in outcome.rows}
    assert len(by_point) == 3
    assert by_point[(0.2, 2.0e-3)].status == "finished" and by_point[(0.2, 2.0e-3)].epochs == 2
    weak = by_point[(0.2, 1.0e-7)]
    assert weak.status == "stopped early" and weak.epochs == 1
    assert weak.metric < by_point[(0.2, 2.0e-3)].metric
    failed = by_point[(1.5, 2.0e-3)]
    assert failed.status == "failed" and failed.metric is None
    assert "non-finite" in failed.error, failed.error
    assert outcome.best is by_point[(0.2, 2.0e-3)]


def test_the_parent_run_has_one_child_per_trial_with_its_params_status_and_curves(asha_sweep, mlflow_server):
    sweep, outcome = asha_sweep
    client = MlflowClient(mlflow_server)
    parent = client.get_run(outcome.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["pairsim.search"] == "grid" and parent.data.tags["pairsim.scheduler"] == "asha"
    assert parent.data.params["space.1.loss.base.cos_margin"] == "grid[1.5]"
    assert parent.data.metrics["trials/stopped_early"] == 1 and parent.data.metrics["trials/failed"] == 1
    artifacts = {a.path for a in client.list_artifacts(outcome.parent_run_id)}
    assert {"results.csv", "best.yaml", *results.PLOTS} <= artifacts, artifacts
    assert sorted(i.tags[0].value for i in parent.inputs.dataset_inputs) == ["training", "validation"]

    children = tracking.child_runs(mlflow_server, outcome.parent_run_id)
    assert len(children) == 3 and len({c.data.tags[tracking.RUN_NAME_TAG] for c in children}) == 3
    expected = {"finished": "FINISHED", "stopped early": "KILLED", "failed": "FAILED"}
    for row in outcome.rows:
        child = client.get_run(row.run_id)
        assert child.data.tags[tracking.PARENT_TAG] == outcome.parent_run_id
        assert child.info.status == expected[row.status], (row, child.info.status)
        assert child.data.tags[results.STATUS_TAG] == row.status.replace(" ", "_")
        assert float(child.data.params["loss.base.cos_margin"]) == row.point["loss.base.cos_margin"]
        assert float(child.data.params["optim.lr"]) == row.point["optim.lr"]
        curve = client.get_metric_history(row.run_id, tracking.metric_key(sweep.metric))
        assert len(curve) == row.epochs, (row, curve)
    failed = [client.get_run(r.run_id) for r in outcome.rows if r.status == "failed"]
    assert all("non-finite" in run.data.tags["pairsim.error"] for run in failed)


def test_trial_runs_live_under_the_sweep_with_unique_absolute_paths(asha_sweep):
    sweep, outcome = asha_sweep
    runs = sorted((outcome.out_dir / "runs").iterdir())
    assert outcome.out_dir.is_absolute()
    assert [p.name for p in runs] == sorted(f"asha-{r.trial_id}" for r in outcome.rows)


def test_best_yaml_reproduces_the_best_trials_config(asha_sweep, mlflow_server):
    sweep, outcome = asha_sweep
    best = load_config(outcome.out_dir / "best.yaml")
    assert best == sweep.trial_config(outcome.best.point)
    trial_params = MlflowClient(mlflow_server).get_run(outcome.best.run_id).data.params
    own = {"ray.run_name", "ray.storage_path", "data.max_cpus"}  # where the trial ran, not what it trained
    flat = {k: "None" if v is None else str(v) for k, v in best.flat().items()}
    assert {k: v for k, v in flat.items() if k not in own} == {k: v for k, v in trial_params.items() if k not in own}


def test_plots_are_pictures(asha_sweep):
    _, outcome = asha_sweep
    from PIL import Image

    for name in results.PLOTS:
        with Image.open(outcome.out_dir / name) as image:
            assert image.format == "PNG" and image.width > 300


def _children(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return [r for r in client.search_runs([found.experiment_id]) if tracking.PARENT_TAG in r.data.tags]


@pytest.mark.extended  # ~6 min: three trial start-ups and two driver start-ups
def test_a_sweep_driver_stopped_mid_sweep_resumes_into_the_same_parent(ray_instance, tiny_dataset, tmp_path):
    """Two trials drawn by Optuna, one at a time: the driver (a `pairsim tune` process on the
    session's Ray instance) gets SIGTERM (`ray job stop`, `kill`) once one trial has ended and the
    next one is training: the parent and the trial it interrupted end KILLED, not RUNNING;
    `--resume` finishes the sweep."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "killed.yaml", tiny_dataset, tmp_path / "ray", uri,
                       {"loss.base.margin": {"uniform": [0.05, 0.3]}},
                       {"search": "optuna", "num_samples": 2, "scheduler": "fifo", "max_concurrent_trials": 1})
    env = {**os.environ, "RAY_ADDRESS": ray_instance.get_runtime_context().gcs_address,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pairsim.cli", "tune", "--space", str(path)]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(command + ["--name", "killed"], env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and first.poll() is None:
        children = _children(uri, "killed")
        if any(c.info.status != "RUNNING" for c in children) and any(
                c.info.status == "RUNNING" and "perf/startup_s" in c.data.metrics for c in children):
            break
        time.sleep(3)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()[-3000:]
    before = {c.data.tags[tracking.RUN_NAME_TAG]: c for c in _children(uri, "killed")}
    stopped = {name: c for name, c in before.items() if tracking.STOPPED_TAG in c.data.tags}
    ended = {name: c for name, c in before.items() if name not in stopped}
    assert [c.info.status for c in stopped.values()] == ["KILLED"], (tmp_path / "first.log").read_text()[-3000:]
    assert [c.info.status for c in ended.values()] == ["FINISHED"]
    client = MlflowClient(uri)
    [parent] = client.search_runs([client.get_experiment_by_name("killed").experiment_id],
                                  filter_string=f"tags.`{tracking.SWEEP_TAG}` = 'killed'")
    assert parent.info.status == "KILLED"

    resumed = subprocess.run(command + ["--resume", "killed"], env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    client = MlflowClient(uri)
    parents = client.search_runs([client.get_experiment_by_name("killed").experiment_id],
                                 filter_string=f"tags.`{tracking.SWEEP_TAG}` = 'killed'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    after = _children(uri, "killed")
    names = [c.data.tags[tracking.RUN_NAME_TAG] for c in after]
    assert len(names) == 2 and len(set(names)) == 2  # no duplicate child for the interrupted trial
    assert all(c.data.tags[tracking.PARENT_TAG] == parents[0].info.run_id for c in after)
    assert all(c.info.status == "FINISHED" for c in after)
    for name, child in ended.items():  # the finished trial was not run again
        again = client.get_run(child.info.run_id)
        assert again.info.end_time == child.info.end_time and again.data.tags["pairsim.attempts"] == "1"
    interrupted = next(c for c in after if c.data.tags[tracking.RUN_NAME_TAG] in set(before) - set(ended))
    assert interrupted.data.tags["pairsim.attempts"] == "2"
    assert "resumed" in resumed.stdout + resumed.stderr


def test_trials_that_do_not_fit_the_cluster_are_refused_before_the_sweep(ray_instance, tiny_dataset, tmp_path):
    """The session's instance has 4 CPUs: a trial of 4 workers + 1 Data CPU does not fit, nor do
    3 concurrent trials of 1 + 1; 2 of them do."""
    from pairsim.config import ConfigError
    from pairsim.tune.sweep import concurrency

    def sweep_with(**settings):
        path = write_sweep(tmp_path / "fit.yaml", tiny_dataset, tmp_path / "ray", f"sqlite:///{tmp_path}/m.db",
                           {"loss.base.margin": {"uniform": [0.05, 0.3]}}, {"scheduler": "fifo", **settings})
        return load_sweep(path)

    with pytest.raises(ConfigError) as exc:
        concurrency(sweep_with(resources={"num_workers": 4}))
    assert exc.value.keys == ("sweep.resources",) and "5 CPU" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        concurrency(sweep_with(max_concurrent_trials=3))
    assert exc.value.keys == ("sweep.max_concurrent_trials",) and "(2 do)" in str(exc.value)
    assert concurrency(sweep_with()) == 2 and concurrency(sweep_with(max_concurrent_trials=1)) == 1


def test_a_union_of_grids_runs_its_points_once_each(ray_instance, tiny_dataset, tmp_path):
    """Three grids, two trials at once: m = 0.3 (γ the base's 20), γ = 40 (m the base's 0.1), and
    (0.3, 20) again. The union's two points run, once each, and not the cross of the keys (0.3,
    40); the table, results.csv, the plots, the parent's params and a child run per trial are
    there as for any sweep. The two trials share the session's 4 CPUs, each 1 worker + 1 CPU
    for Ray Data: both stream their data and finish (no trial starves the other's ingest), and
    their runs overlap in time; they carry the sweep driver's source tags, not the trial actor's."""
    import csv

    from pairsim.tune.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "union.yaml", tiny_dataset, tmp_path / "ray", uri,
                       [{"loss.base.margin": {"grid": [0.3]}}, {"loss.base.gamma": {"grid": [40]}},
                        {"loss.base.margin": {"grid": [0.3]}, "loss.base.gamma": {"grid": [20]}}],
                       {"search": "grid", "num_samples": 1, "scheduler": "fifo", "max_concurrent_trials": 2})
    sweep = load_sweep(path, ["train.epochs=1", "loss.base.gamma=20", "loss.base.margin=0.1"])
    outcome = run_sweep(sweep, "union")
    points = [{"loss.base.margin": 0.3, "loss.base.gamma": 20.0}, {"loss.base.margin": 0.1, "loss.base.gamma": 40}]
    assert sorted((r.point for r in outcome.rows), key=str) == sorted(points, key=str)
    assert [r.status for r in outcome.rows] == ["finished", "finished"] and outcome.best is not None
    with open(outcome.out_dir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert sorted((float(r["loss.base.margin"]), float(r["loss.base.gamma"])) for r in table) == [(0.1, 40.0), (0.3, 20.0)]
    assert all(r["mlflow_run_id"] for r in table)
    client = MlflowClient(uri)
    parent = client.get_run(outcome.parent_run_id)
    assert parent.data.params["space.1.loss.base.gamma"] == "grid[40]"
    assert {"results.csv", "best.yaml", *results.PLOTS} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    runs = [client.get_run(r.run_id) for r in outcome.rows]
    assert all("val/rsum" in run.data.metrics for run in runs)
    (a, b) = [(run.info.start_time, run.info.end_time) for run in runs]
    assert a[0] < b[1] and b[0] < a[1], "the trials ran one after the other"
    assert {run.data.tags["mlflow.source.name"] for run in runs} == {tracking.context_tags()["mlflow.source.name"]}
    for row in outcome.rows:
        child = client.get_run(row.run_id)
        assert child.data.tags[tracking.PARENT_TAG] == outcome.parent_run_id and child.info.status == "FINISHED"
        assert (float(child.data.params["loss.base.margin"]), float(child.data.params["loss.base.gamma"])) == (
            row.point["loss.base.margin"], row.point["loss.base.gamma"])
    assert load_config(outcome.out_dir / "best.yaml") == sweep.trial_config(outcome.best.point)


def test_pbt_a_weak_trial_continues_from_a_strong_ones_checkpoint(ray_instance, tiny_dataset, tmp_path):
    """Population Based Training, 2 warm trials of 2 epochs taking turns on the instance (one at a
    time: each pauses after epoch 1 and resumes from its checkpoint, in a reused trial actor). Learning rates 2e-3 and
    1e-7: once both have reported epoch 1, the lower half (lr 1e-7, learns nothing) continues
    from the upper half's epoch-1 checkpoint with its hyperparameters explored (lr ×1.2 or ×0.8,
    or drawn anew). Its MLflow child run records the clone and its learning rate per epoch; the
    population picture is in the parent run."""
    from pairsim.tune.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "pbt.yaml", tiny_dataset, tmp_path / "ray", uri,
                       {"optim.lr": {"grid": [2.0e-3, 1.0e-7]}},
                       {"search": "grid", "num_samples": 1, "scheduler": "pbt", "max_concurrent_trials": 1,
                        "warm": True, "pbt": {"perturbation_interval": 1, "quantile_fraction": 0.5,
                                              "mutations": {"optim.lr": {"loguniform": [1.0e-4, 3.0e-3]}}}})
    sweep = load_sweep(path)
    outcome = run_sweep(sweep, "pbt")
    assert len(outcome.rows) == 2 and {r.status for r in outcome.rows} == {"finished"}
    assert all(r.epochs == 2 for r in outcome.rows)
    by_id = {r.trial_id: r for r in outcome.rows}
    first, second = sorted(by_id)  # Tune numbers the grid's trials in order
    clone = by_id[second]  # the lower half (lr 1e-7) continues from the upper half (lr 2e-3)
    assert [e for e, _ in clone.clones] == [1] and clone.clones[0][1] == first, [
        (r.trial_id, r.point, r.clones) for r in outcome.rows]
    assert not by_id[first].clones
    assert 1.0e-4 <= clone.point["optim.lr"] <= 3.0e-3  # the first's 2e-3, explored and clipped
    curve = dict(clone.curve)
    assert curve[2] > curve[1] + 20, curve  # from the first's weights: far above what lr 1e-7 reached
    client = MlflowClient(uri)
    child = client.get_run(clone.run_id)
    assert child.data.tags["pairsim.pbt.cloned_from"] == clone.clones[0][1]
    lrs = [m.value for m in sorted(client.get_metric_history(clone.run_id, "hparam/optim.lr"), key=lambda m: m.step)]
    assert lrs[0] == pytest.approx(1.0e-7) and lrs[-1] == pytest.approx(clone.point["optim.lr"]), lrs
    assert (tmp_path / "ray" / "pbt" / "runs" / f"pbt-{second}.before-epoch-1").is_dir()  # its own lineage, set aside
    assert "metric_vs_epoch.png" in {a.path for a in client.list_artifacts(outcome.parent_run_id)}
    assert load_config(outcome.out_dir / "best.yaml") == sweep.trial_config(outcome.best.point)


@pytest.mark.extended  # ~4 min: six trial start-ups, six trial-epochs
def test_pb2_proposes_a_clones_lr_once_the_population_has_progress_to_learn_from(ray_instance, tiny_dataset,
                                                                                    tmp_path):
    """Population Based Bandits, 2 trials of 3 epochs taking turns, compared after epochs 1 and 2:
    learning rates 2e-3 and 1e-7, the mutation's bounds [1e-6, 1e-5]. PB2 records each trial at
    each comparison and learns from a trial's change between two records with the same values.
    After epoch 1 it has none: the lr-1e-7 trial continues from the other's checkpoint with the
    donor's lr as it is, kept inside the bounds (1e-5), so it barely trains on. After epoch 2 the
    lr-2e-3 trial, unexplored, is ahead again with two records at one lr, and the clone takes its
    checkpoint with a learning rate PB2's Gaussian process proposed inside the bounds (not the
    copy's 1e-5), recorded per epoch in its MLflow child run."""
    from pairsim.tune.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "pb2.yaml", tiny_dataset, tmp_path / "ray", uri,
                       {"optim.lr": {"grid": [2.0e-3, 1.0e-7]}},
                       {"search": "grid", "num_samples": 1, "scheduler": "pb2", "max_concurrent_trials": 1,
                        "pbt": {"perturbation_interval": 1, "quantile_fraction": 0.5,
                                "mutations": {"optim.lr": {"loguniform": [1.0e-6, 1.0e-5]}}}})
    outcome = run_sweep(load_sweep(path, ["train.epochs=3"]), "pb2")
    assert len(outcome.rows) == 2 and {r.status for r in outcome.rows} == {"finished"}
    assert all(r.epochs == 3 for r in outcome.rows)
    by_id = {r.trial_id: r for r in outcome.rows}
    first, second = sorted(by_id)
    clone = by_id[second]
    assert clone.clones == [(1, first), (2, first)] and not by_id[first].clones, [
        (r.trial_id, r.point, r.clones) for r in outcome.rows]
    assert by_id[first].point["optim.lr"] == 2.0e-3
    lrs = [m.value for m in sorted(MlflowClient(uri).get_metric_history(clone.run_id, "hparam/optim.lr"),
                                   key=lambda m: m.step)]
    assert lrs[:2] == pytest.approx([1.0e-7, 1.0e-5]), lrs
    assert 1.0e-6 <= lrs[2] < 1.0e-5 and lrs[2] == pytest.approx(clone.point["optim.lr"]), lrs  # proposed
    curve = dict(clone.curve)
    assert curve[2] > curve[1] + 10, curve  # from the first's epoch-1 weights


def test_several_metrics_give_a_pareto_front(ray_instance, tiny_dataset, tmp_path, capsys):
    """Optuna's multi-objective TPE over m and γ for val RSUM and image→image mAP@R, 3 warm trials
    of one epoch, two at a time (two trial actors): the front in ``pareto.csv`` is what no trial dominates (by the trials' last-epoch
    values in ``results.csv``), each front trial's ``front/<trial>.yaml`` is its run config, the
    row printed as each trial ends shows its last i2i mAP@R too, and the parent run holds the
    front, its picture and those files."""
    import csv

    from pairsim.tune.results import pareto_front
    from pairsim.tune.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "front.yaml", tiny_dataset, tmp_path / "ray", uri,
                       {"loss.base.margin": {"uniform": [0.0, 0.4]}, "loss.base.gamma": {"loguniform": [10, 60]}},
                       {"search": "optuna", "num_samples": 3, "metric": ["rsum", "i2i_mAP@R"],
                        "max_concurrent_trials": 2, "warm": True})
    sweep = load_sweep(path, ["train.epochs=1"])
    outcome = run_sweep(sweep, "front")
    assert len(outcome.rows) == 3 and {r.status for r in outcome.rows} == {"finished"}
    assert all(set(r.values) == {"val/rsum", "val/i2i_mAP@R"} for r in outcome.rows)
    with open(outcome.out_dir / "pareto.csv") as f:
        front = list(csv.DictReader(f))
    with open(outcome.out_dir / "results.csv") as f:
        table = {r["trial_id"]: (float(r["last val/rsum"]), float(r["last val/i2i_mAP@R"])) for r in csv.DictReader(f)}
    on_front = {r["trial_id"] for r in front}
    assert on_front == {r.trial_id for r in pareto_front(outcome.rows, sweep.objectives)}
    for trial, (rsum, mapr) in table.items():  # dominated iff off the front, from the CSV's numbers
        beaten = any(o[0] >= rsum and o[1] >= mapr and o != (rsum, mapr) for o in table.values())
        assert beaten == (trial not in on_front), (trial, table, on_front)
    printed = capsys.readouterr().out
    for trial, (rsum, mapr) in table.items():  # as each trial ended, before the final table
        assert re.search(rf"^{trial}\s.*\s{rsum:.2f}\s+{mapr:.2f}\s+1\s+finished", printed, re.M), printed
    for row in front:
        point = {k: float(row[k]) for k in sweep.keys}
        assert load_config(outcome.out_dir / "front" / f"{row['trial_id']}.yaml") == sweep.trial_config(point)
    client = MlflowClient(uri)
    artifacts = {a.path for a in client.list_artifacts(outcome.parent_run_id)}
    assert {"pareto.csv", "pareto.png", "front", "results.csv", "best.yaml"} <= artifacts
    assert len(client.list_artifacts(outcome.parent_run_id, "front")) == len(front)
    assert client.get_run(outcome.parent_run_id).data.params["sweep.metric"] == "val/rsum,val/i2i_mAP@R"
