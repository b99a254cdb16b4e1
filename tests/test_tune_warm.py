"""Warm sweeps (``sweep.warm``): each trial trains in its Tune trial actor, which Tune reuses for
the next trial. The trials of one actor share its process and leave nothing behind for the next
(seeds, DeepSpeed's globals, the process group, MLflow's threads): a point trained three times in one
process gives the same per-epoch val metrics each time, and those of the same config trained by
a one-worker ``TorchTrainer``; the process holds no more threads or memory as the third trial
starts than as the second did. The ASHA and PBT sweeps of ``test_tune`` run warm as well."""

import json

import pytest
from mlflow.tracking import MlflowClient

from pairsim.tune.space import load_sweep
from pairsim.tune.trial import PROCESS_AT_START_TAG, PROCESS_TAG
from test_tune import write_sweep

pytestmark = pytest.mark.slow

LR = 2.0e-3


def val_curves(client: MlflowClient, run_id: str) -> dict[str, list[float]]:
    """Every ``val/`` metric of a run, by epoch (its logged steps in order)."""
    names = [name for name in client.get_run(run_id).data.metrics if name.startswith("val/")]
    return {name: [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]
            for name in names}


def test_warm_trials_share_their_actor_leave_nothing_behind_and_train_as_a_one_worker_trainer(ray_instance, tiny_dataset,
                                                                                 tmp_path):
    from pairsim.train import driver
    from pairsim.tune.sweep import run_sweep

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    path = write_sweep(tmp_path / "warm.yaml", tiny_dataset, tmp_path / "ray", uri, {"optim.lr": {"grid": [LR]}},
                       {"search": "grid", "num_samples": 3, "scheduler": "fifo", "max_concurrent_trials": 1,
                        "warm": True})
    sweep = load_sweep(path)
    outcome = run_sweep(sweep, "warm")
    assert len(outcome.rows) == 3 and {r.status for r in outcome.rows} == {"finished"}
    client = MlflowClient(uri)
    rows = sorted(outcome.rows, key=lambda r: r.trial_id)
    runs = [client.get_run(r.run_id) for r in rows]
    assert len({run.data.tags[PROCESS_TAG] for run in runs}) == 1  # one actor ran all three
    first, *again = (val_curves(client, r.run_id) for r in rows)
    assert len(first["val/rsum"]) == 2 and again == [first, first]  # later runs in the process: the same digits
    # what the first trial started (Ray Data's and MLflow's pools) the later ones reuse: nothing more stays
    second, third = (json.loads(run.data.tags[PROCESS_AT_START_TAG]) for run in runs[1:])
    assert third["threads"] <= second["threads"], (second, third)
    assert third["rss_mib"] < second["rss_mib"] * 1.1, (second, third)

    cfg = sweep.trial_config({"optim.lr": LR})  # the same trial, its worker in a TorchTrainer
    cold = driver.fit(cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"run_name": "cold",
                                                                               "storage_path": tmp_path / "cold"})}))
    assert val_curves(client, cold.mlflow_run_id) == first

