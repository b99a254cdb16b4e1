"""Faults injected into real training runs (2 Ray Train workers, DeepSpeed ZeRO-2, Ray Data,
an MLflow store), each ending with what must hold: no finished epoch, checkpoint or metric lost,
nothing logged twice, and a clear message naming what went wrong.

The README's table "What pairsim survives" lists these with the other faults' tests."""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

import toy_loss  # noqa: F401  (registers the toy losses here; workers import them from the pickled config)
from conftest import (STEPS_PER_EPOCH, complete_checkpoints, e2e_overrides, start_mlflow_server, steps_logged_twice,
                      unused_port)
from pairsim import log, storage, tracking
from pairsim.cli import DEMO_CONFIG, main
from pairsim.compat.ray import train_record_checkpoints
from pairsim.config import load_config
from pairsim.build import build_objective
from pairsim.train import checkpoints, driver

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parents[1]


def registered(run_dir: Path) -> set[str]:
    """The checkpoints Ray Train's record of the run names."""
    try:
        return set(train_record_checkpoints(storage.Location.of(run_dir)))
    except ValueError:  # being written
        return set()


@pytest.fixture(autouse=True)
def pairsim_messages():
    """pairsim's messages on stderr at INFO, in the driver and (given its level) the workers,
    whichever test ran before; the logger as it was afterwards."""
    logger = logging.getLogger("pairsim")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    log.setup("INFO")
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def wait_for(condition, what: str, proc: subprocess.Popen, output: Path, started: set[psutil.Process],
             timeout: float = 600):
    """Poll ``condition`` each second while ``proc`` runs; ``started`` collects the processes
    it starts (a Ray instance), to be stopped even if ``proc`` ends first."""
    deadline = time.time() + timeout
    while not condition():
        with contextlib.suppress(psutil.NoSuchProcess):
            started.update(psutil.Process(proc.pid).children(recursive=True))
        assert proc.poll() is None, f"the run ended before {what}:\n{output.read_text()[-4000:]}"
        assert time.time() < deadline, f"no {what} in {timeout} s:\n{output.read_text()[-4000:]}"
        time.sleep(1)


def test_killed_worker_killed_driver_and_a_deleted_checkpoint_lose_no_finished_work(ray_instance, tiny_dataset,
                                                                                     tmp_path, capfd):
    """`pairsim train` (its own local Ray instance, 4 epochs, ray.max_failures=1): a training
    worker is SIGKILLed after epoch 1's checkpoint (Ray Train restarts the group from it), the
    driver is SIGKILLed after epoch 3's (with the Ray instance it started); then epoch 3's
    checkpoint is deleted by hand (Ray Train refused such a run directory) and epoch 2's model
    states are altered on disk. The re-run reports both, resumes from epoch 1's checkpoint into
    the same MLflow run and finishes, with every metric step logged once. Three checkpoints are
    kept besides the latest: with two, Ray Train deleted epoch 1's at epoch 3 whenever the
    worker's kill came after Ray had ranked it (most runs ranked it too late to)."""
    run_dir, hold = tmp_path / "ray" / "faults", tmp_path / "hold"
    hold.touch()  # the run waits at epoch 4's first step while it exists: the driver is killed there, not later
    args = e2e_overrides(tiny_dataset, tmp_path, "ray.run_name=faults", "train.epochs=4", "data.test_split=null",
                         "ray.max_failures=1", "ray.checkpoints_kept=3", "loss.base=cos_hinge_held",
                         f"loss.base.run_dir={run_dir}", f"loss.base.hold_file={hold}", "loss.base.hold_from_epoch=3")
    first_log = tmp_path / "first.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONUNBUFFERED": "1"}  # SIGKILL ahead
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])  # the toy losses
    first = subprocess.Popen([sys.executable, "-m", "pairsim.cli", "train", "--config", str(DEMO_CONFIG),
                              *(f"--set={a}" for a in args)],
                             env=env, cwd=tmp_path, stdout=first_log.open("w"), stderr=subprocess.STDOUT)
    instance: set[psutil.Process] = set()  # the local Ray instance the driver starts
    try:
        wait_for(lambda: len(complete_checkpoints(run_dir)) == 1, "checkpoint of epoch 1", first, first_log, instance)
        [worker, *_] = [p for p in psutil.Process(first.pid).children(recursive=True)
                        if "RayTrainWorker" in " ".join(p.cmdline())]
        worker.kill()
        wait_for(lambda: len(complete_checkpoints(run_dir)) == 3 and complete_checkpoints(run_dir)[-1].name in
                 registered(run_dir), "epoch 3's checkpoint in Ray Train's record", first, first_log, instance)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            instance.update(psutil.Process(first.pid).children(recursive=True))
        first.kill()  # SIGKILL: no handler runs, the MLflow run stays RUNNING
        first.wait()
        for proc in instance:  # what is still up of it (Ray's agents outlive their raylet for a while)
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(instance, timeout=60)
    first_out = first_log.read_text()
    assert "resumed from checkpoint: epoch 2, step 16" in first_out, first_out[-4000:]  # the worker group's restart
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = tracking.find_run(uri, "faults")
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"

    epoch1, epoch2, epoch3 = complete_checkpoints(run_dir)
    hold.unlink()
    shutil.rmtree(epoch3)
    states = epoch2 / checkpoints.CHECKPOINT_TAG / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))
    assert main(["checkpoints", "verify", str(run_dir)]) == 1
    capfd.readouterr()
    result = driver.fit(load_config(DEMO_CONFIG, args))
    out = "".join(capfd.readouterr())
    assert f"Ray Train's record of the run names checkpoints that are gone ({epoch3.name})" in out
    assert f"checkpoint {epoch2} is skipped: {checkpoints.CHECKPOINT_TAG}/mp_rank_00_model_states.pt: content " \
           "differs from its checksum" in out
    deadline = time.time() + 60  # a worker's line, which Ray forwards to the driver a while later on a busy machine
    while "resumed from checkpoint" not in out and time.time() < deadline:
        time.sleep(1)
        out += "".join(capfd.readouterr())
    assert "resumed from checkpoint: epoch 2, step 16" in out
    assert result.mlflow_run_id == run_id and result.metrics["step"] == 4 * STEPS_PER_EPOCH
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["pairsim.attempts"] == "2"
    assert steps_logged_twice(client, run_id) == {}
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == \
        list(range(2, 4 * STEPS_PER_EPOCH + 1, 2))
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/rsum")) == \
        [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH, 4 * STEPS_PER_EPOCH]
    assert epoch1.is_dir() and not checkpoints.verify_checkpoint(epoch1)
    sound = [p for p in sorted(run_dir.glob("checkpoint_*")) if not checkpoints.verify_checkpoint(p)]  # oldest first
    cards = [checkpoints.checkpoint_card(p) for p in sound]
    best = max(reversed(cards), key=lambda card: card.val["val/rsum"])  # ties: the newest
    assert run.data.tags["pairsim.best_epoch"] == str(best.epoch)  # epoch 1 competes, unranked by Ray's new record


# Runs inside a user and mount namespace (``unshare -rm``): there, an unprivileged user may mount
# a tmpfs, and the runs' Ray instances (started inside) write their checkpoints to it. Arguments:
# the mount point, the report's path, the train command's arguments.
FULL_DISK_SCENARIO = """
import json, subprocess, sys
from pathlib import Path
from pairsim.train import checkpoints
disk, report, *train = sys.argv[1:]
def mount(options):
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", disk], check=True)
def run():
    done = subprocess.run([sys.executable, "-c", "import sys; from pairsim.cli import main; sys.exit(main())",
                           "train", *train], capture_output=True, text=True)
    return {"code": done.returncode, "output": done.stdout + done.stderr}
mount("size=150m")  # room for one checkpoint of the tiny model (~100 MiB), not two
first = run()
kept = [p for p in (Path(disk) / "full").glob("checkpoint_*") if p.is_dir() and not checkpoints.verify_checkpoint(p)]
kept_epochs = [checkpoints.checkpoint_card(p).epoch for p in kept]
mount("remount,size=600m")  # room made
json.dump({"first": first, "kept_epochs": kept_epochs, "second": run()}, open(report, "w"))
"""


def test_a_full_disk_during_a_checkpoint_keeps_the_last_one_and_the_run_resumes(tiny_dataset, tmp_path):
    """Checkpoints go to a disk with room for one: epoch 2's save fails, the run stops FAILED
    naming the full disk, epoch 1's checkpoint still verifies; with room made (the tmpfs
    grown), the re-run skips what the failed save left and resumes from epoch 1. Both runs are
    `pairsim train` with its own Ray instance, in a user and mount namespace that holds the
    tmpfs: no root needed where unprivileged user namespaces are allowed (most distributions)."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no user namespace to mount a small disk in (unshare -rm: {probe.stderr.strip()})")
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*e2e_overrides(tiny_dataset, tmp_path, "ray.run_name=full", "train.epochs=2", "data.test_split=null"),
            f"ray.storage_path={disk}"]
    train = ["--config", str(DEMO_CONFIG), *(arg for override in args for arg in ("--set", override))]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own instance, inside the namespace
    subprocess.run(["unshare", "-rm", "--propagation", "private", sys.executable, "-c", FULL_DISK_SCENARIO, str(disk),
                    str(tmp_path / "report.json"), *train], env=env, check=True, timeout=1200)
    report = json.loads((tmp_path / "report.json").read_text())
    first, second = report["first"], report["second"]
    assert first["code"] == 1 and "No space left on device" in first["output"], first["output"][-4000:]
    assert report["kept_epochs"] == [1]
    assert second["code"] == 0, second["output"][-4000:]
    assert "resumed from checkpoint: epoch 2" in second["output"]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.get_run(tracking.find_run(uri, "full"))
    assert run.info.status == "FINISHED" and tracking.ERROR_TAG not in run.data.tags
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2  # epoch 1's once, epoch 2's
    assert "No space left on device" in run.data.tags[f"{tracking.ERROR_TAG}.attempt1"]
    assert steps_logged_twice(client, run.info.run_id) == {}


def test_a_nan_loss_stops_the_run_naming_its_step_and_keeps_the_last_checkpoint(ray_instance, tiny_dataset, tmp_path):
    """A loss that turns NaN at epoch 2's 4th step: the run stops there (no further step
    trains on NaN weights), FAILED in MLflow with the step named; epoch 1's checkpoint verifies."""
    probe = build_objective(load_config(None, ["loss.base=cos_hinge_nan_after", "loss.base.finite_calls=1000"]).loss)
    features = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    probe(image=features, text=features, group_ids=torch.arange(8))
    calls_per_step = probe.structure.base.calls
    bad_step = STEPS_PER_EPOCH + 4
    args = e2e_overrides(tiny_dataset, tmp_path, "ray.run_name=nan", "train.epochs=2", "data.test_split=null",
                         "loss.base=cos_hinge_nan_after", f"loss.base.finite_calls={calls_per_step * (bad_step - 1)}")
    with pytest.raises(Exception) as failed:
        driver.fit(load_config(DEMO_CONFIG, args))
    assert f"epoch 2 step {bad_step}: non-finite loss terms" in str(failed.value)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = MlflowClient(uri).get_run(tracking.find_run(uri, "nan"))
    assert run.info.status == "FAILED" and f"epoch 2 step {bad_step}" in run.data.tags[tracking.ERROR_TAG]
    logged = sorted(m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "train/loss"))
    assert logged == list(range(2, bad_step, 2))  # the buffered curve reached MLflow before the worker died
    [kept] = complete_checkpoints(tmp_path / "ray" / "nan")
    assert not checkpoints.verify_checkpoint(kept) and checkpoints.checkpoint_card(kept).epoch == 1


def test_an_mlflow_server_gone_mid_run_loses_no_metric(ray_instance, tiny_dataset, tmp_path, capfd):
    """Training logs to an `mlflow server` that is stopped once epoch 1's checkpoint exists and
    started again 20 s later: training goes on without it, and the run ends FINISHED with
    every step's metrics there, each once."""
    root, port = tmp_path / "mlflow", unused_port()
    root.mkdir()
    servers = [start_mlflow_server(root, port)]
    uri = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "ray" / "outage"

    def outage():
        deadline = time.time() + 600
        while not complete_checkpoints(run_dir) and time.time() < deadline:
            time.sleep(0.5)
        servers[0].terminate()  # its worker process with it (SIGKILL would leave that one serving)
        servers[0].wait()
        time.sleep(20)
        servers.append(start_mlflow_server(root, port))

    killer = threading.Thread(target=outage, daemon=True)
    killer.start()
    try:
        result = driver.fit(load_config(DEMO_CONFIG, e2e_overrides(
            tiny_dataset, tmp_path, "ray.run_name=outage", "train.epochs=2", "data.test_split=null",
            f"tracking.tracking_uri={uri}")))
        killer.join(timeout=300)
        assert len(servers) == 2, "the server was not restarted"
        client = MlflowClient(uri)
        run = client.get_run(result.mlflow_run_id)
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == \
            list(range(2, 2 * STEPS_PER_EPOCH + 1, 2))
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/rsum")) == \
            [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
        assert "MLflow cannot be reached" in "".join(capfd.readouterr())
    finally:
        for server in servers:
            server.terminate()
            server.wait()
